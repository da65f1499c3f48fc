"""Native parts built at install time (metadata lives in pyproject.toml).

transports/_wire (csrc/wire.c) is optional: where it cannot be compiled the install goes
on and transports use the Python frame codec (transports.frame.NATIVE is then None).
"""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "transports._wire",
            sources=["csrc/wire.c"],
            libraries=["z"],
            extra_compile_args=["-O2", "-std=gnu11"],
            optional=True,
        )
    ]
)
