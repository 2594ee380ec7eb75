"""The drafter model, its attention rule, the DFlash objective and the fixed-shape train step."""
