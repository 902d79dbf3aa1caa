"""Structured outputs: constrain generation to choices, a regex, a JSON schema or a grammar.

`StructuredOutputsParams` (the user's spec) lives in `mmkit.sampling_params`. This package holds
the xgrammar backend: spec -> grammar text (`spec`), the compile cache built once per engine
(`backend`), per-sequence matchers (`request`), the batch token bitmask (`bitmask`), and the
OpenAI request-field conversion for the server (`openai`). Nothing here imports xgrammar at
module import time, so `import mmkit` stays light.
"""
