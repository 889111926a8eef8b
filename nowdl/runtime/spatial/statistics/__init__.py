"""Whole-image statistics gathered over pieces of the image, exactly.

``accumulate`` adds chunks of a norm's or a pooling's input in float64 (shifted sums, Chan's
combination, one all-reduce of rank slots) and applies the result: predict's statistics passes
over windows use it, and so does ``seq_norms``, which runs the statistics passes of a stage on
sequential tiles in training (forward statistics and the backward's gradient means).
"""
