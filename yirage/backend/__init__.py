"""Backend interface, plugin hooks, discovery, registry and selection."""
