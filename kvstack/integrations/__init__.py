"""Integrations with serving engines, each in its own subpackage with its own optional dependencies."""
