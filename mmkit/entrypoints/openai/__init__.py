"""The OpenAI-compatible HTTP server behind `mmkit serve` (FastAPI + uvicorn).

    from mmkit.entrypoints.openai.api_server import create_app, run_server
"""
