"""labserver: how should a web server feed a transformers pipeline? Run it and see.

Importing the package configures nothing and loads no model; torch is imported
only when a real model is loaded.
"""

from __future__ import annotations

from .config import ServerConfig
from .launch import ServerHandle, serve, serve_async
from .models import load_model
from .strategies import STRATEGIES, GenStrategy, Limits, Strategy, register

__all__ = [
    "STRATEGIES",
    "GenStrategy",
    "Limits",
    "ServerConfig",
    "ServerHandle",
    "Strategy",
    "load_model",
    "register",
    "serve",
    "serve_async",
]
__version__ = "0.1.0"
