"""Norms on sequential tiles: which schedule gathers their statistics (the statistics passes or the
layer-wise forward) and what it costs ([Note: layer-wise norms cost] in ``schedule``)."""
