"""Helpers for the Triton Python-backend models: request parsing, the engine loop, metrics, the server launcher."""
