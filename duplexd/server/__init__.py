"""The duplexd server: FastAPI WebSocket fronts (Kyutai protocol, OpenAI Realtime subset) over the batched engine.

Imports point one way (server -> engine); nothing here runs model code on the event loop.
"""
