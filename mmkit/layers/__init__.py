"""Building blocks of mmkit's own decoder: paged attention, rotary embedding, norms, sampler."""
