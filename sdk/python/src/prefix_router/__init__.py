"""prefix-router's Python SDK: `Client` for the control plane's gRPC API (`prefixrouter.v1`).

    import prefix_router
    client = prefix_router.Client("http://127.0.0.1:7070")
    client.set_variant_routing_strategy("chat", "v1", "PREFIX_AWARE")
"""

from . import errors, shapes
from .client import STRATEGY_UPDATE_ATTEMPTS, Client
from .errors import PrefixRouterError

__all__ = ["Client", "PrefixRouterError", "STRATEGY_UPDATE_ATTEMPTS", "errors", "shapes"]
