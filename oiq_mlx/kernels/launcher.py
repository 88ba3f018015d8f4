"""The one place kernels are launched; tests replace `launch` with the CPU Metal emulator."""


def launch(kernel, **kwargs):
    """Call an `mx.fast.metal_kernel` with its usual keyword arguments; returns its outputs."""
    return kernel(**kwargs)
