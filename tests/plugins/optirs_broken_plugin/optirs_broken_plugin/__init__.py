"""Broken optirs plugins, one per module, each failing in a different way."""
