"""The engine: requests, scheduling, KV block management and the step loop."""
