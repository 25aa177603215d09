"""Widgets the screens share: chat messages, the stats panel and its expert heat map, the load panel,
the download fit report."""
