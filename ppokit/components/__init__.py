"""Pure tensor math, one module per component kind. Imports torch and ppokit.batch only."""
