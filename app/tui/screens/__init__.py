"""The app's screens: loading, chat, settings, models, download, conversations."""
