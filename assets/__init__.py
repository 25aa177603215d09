"""Data files shipped with moedesk: stylesheet, calibration prompts, example batch."""
