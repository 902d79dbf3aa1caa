"""Model implementations (installed as `mmkit.models`): the registry, LLaVA, the Llama decoder."""
