"""``make demo``'s steps: the speculative config check
(``python -m tools.demo.spec_config``) and an OpenAI-compatible server with
MTP (``python -m tools.demo.serve``; its ``ServeProcess`` is also the
harness of ``tests/server``)."""
