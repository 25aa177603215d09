"""Hand-written compute kernels with pure-torch fallbacks."""
