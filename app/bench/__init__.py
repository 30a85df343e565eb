"""Load generator and benchmark runners (no ray imports: they drive the app over HTTP)."""
