"""Example ppokit plugin: the ``lite_ppo`` advantage estimator.

``ppokit_example.plugin`` is the entry point (torch-free: it registers the component
lazily); ``ppokit_example.advantage`` holds the tensor code.
"""

__version__ = "0.1.0"
