"""The HTTP side of kvserve: an OpenAI-compatible FastAPI app (`api.build_app`), its request schema
(`protocol`), the completion work (`serving`, `render`), and the live KV-cache dashboard."""
