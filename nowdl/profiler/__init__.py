"""Per-node cost measurement and estimation."""
