"""Per-stage module generation from a Plan."""
