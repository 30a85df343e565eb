"""Thin Ray Serve wrappers around app/: ingress, model replica and the app builder. No model logic here."""
