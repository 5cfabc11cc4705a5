"""Graph capture for the plugin: capture sizes and the graph-mode setup."""
