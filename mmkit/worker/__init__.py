"""The worker side: KV cache allocation and the ModelRunner that executes one engine step."""
