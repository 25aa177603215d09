"""The app's screens: loading, chat, settings, models, conversations."""
