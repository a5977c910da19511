"""`h2o-kv serve`: an OpenAI-compatible HTTP server over the continuous-batching Engine.

    from h2o_kv.runtime.serve.app import create_app      # FastAPI app for an Engine
    from h2o_kv.runtime.serve.server import serve_in_thread

Needs the serve extra (fastapi, uvicorn, prometheus_client); the CLI hook (`main.add_parser`)
imports none of them.
"""
