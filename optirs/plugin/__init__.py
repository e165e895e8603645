"""The plugin layer: the hook specifications (THE backend interface) and the registry."""
