"""moedesk engine: everything that computes."""
