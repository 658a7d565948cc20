"""HL-Gauss distributional critic for ppokit."""

__version__ = "0.1.0"
