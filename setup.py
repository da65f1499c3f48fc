"""Native parts built at install time (metadata lives in pyproject.toml).

Each lands beside its package's sources (lamina/model is the model/ folder, through
its link). All are optional: where one cannot be compiled the install goes on without it.
- transports/_wire (csrc/wire.c): without it transports use the Python frame codec
  (lamina.transports.frame.NATIVE is then None).
- model/_kv_attention (csrc/kv_attention.c): without it attention over stored KV runs
  in torch (lamina.model.kv_attention.NATIVE is then None).
- model/_qmatmul (csrc/qmatmul.c): without it linears run in torch, quantized weights
  dequantized at each call (lamina.model.quant.NATIVE is then None).
- model/_slice_ops (csrc/slice_ops.c): without it RMSNorm, RoPE and SiLU run in torch.
"""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "lamina.transports._wire",
            sources=["csrc/wire.c"],
            libraries=["z"],
            extra_compile_args=["-O2", "-std=gnu11"],
            optional=True,
        ),
        Extension(
            "lamina.model._kv_attention",
            sources=["csrc/kv_attention.c"],
            # -ffast-math for vectorized expf (glibc's libmvec); the kernel uses no infinities.
            # -Wno-psabi: its 8-float vectors cross only inlined calls, so no ABI is involved.
            extra_compile_args=["-O3", "-std=gnu11", "-ffast-math", "-funroll-loops", "-Wno-psabi"],
            libraries=["m"],
            optional=True,
        ),
        Extension(
            "lamina.model._qmatmul",
            sources=["csrc/qmatmul.c"],
            # No contraction: decoded weights must round like the reference's d * q + m.
            extra_compile_args=["-O3", "-std=gnu11", "-ffp-contract=off", "-pthread"],
            extra_link_args=["-pthread"],
            optional=True,
        ),
        Extension(
            "lamina.model._slice_ops",
            sources=["csrc/slice_ops.c"],
            extra_compile_args=["-O3", "-std=gnu11", "-ffp-contract=off"],
            libraries=["m"],
            optional=True,
        ),
    ]
)
