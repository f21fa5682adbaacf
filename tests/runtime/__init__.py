"""The kernels generated code calls, per platform, and the emulated IPU."""
