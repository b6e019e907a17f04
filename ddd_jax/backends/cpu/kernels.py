"""The optional CPU kernels behind `ddd_jax.ops` (products and attention), registered with `jax.ffi`.

`pip install` builds `_cpu_kernels*.so` here from `csrc/cpu_kernels.cc` (g++ and jaxlib's FFI headers;
see setup.py). On the CPU backend, float32 work of at most `MAX_ROWS` rows -- decoding and verification -- runs
there: small-M matrix products that read a stacked weight's layer in place (no per-layer copy; weights streamed
once for all rows), and attention over the slots a row may attend only. Products also take float16 weights under
float32 activations (weight-only storage, e.g. a draft head's: half the bytes, widened exactly as they are read,
so the result is the float32 product of the widened weights), and GGUF Q4_1 / Q8_0 / Q4_0 blocks (`quant`:
dequantized exactly into L1, four rows at a time (eight on AVX-512), then the float32 transposed product), and
panel-major float32 weights (`panels`: every panel one contiguous stream, any number of rows; bitwise the
row-major product; float16 panels for a draft head bound to a panel-major target; for greedy decoding's lm_head
the same product also returns each row's first maximum, `greedy_panels`), and GGUF blocks stored panel-major
(`quant.BlockPanels`, `product_qpanels`: dequantized in registers, bitwise `product_panels` of the dequantized
weight), and the same quantized panels multiplied by integer dot products (`product_qpanels_int8`, `gguf_blocks=
"int8"`: activations quantized per 32 values to int8, exact integer block sums, scaled in float32 in one fixed
order -- close to the float32 product, not bitwise, and the same bits for every row count and for every integer
variant, `int8_variant()`; `product_qpanels_int8_group` multiplies one input by several such weights in one call).
Everything else, and every machine where
the library is missing, cannot be loaded or the CPU lacks AVX2/FMA/F16C, takes XLA (one stderr line when the
library is missing or broken). `DDD_JAX_NO_KERNELS=1` disables them. On CPUs with AVX-512 (F/VL/BW/DQ), x @ W
products of 3 to 85 rows (tree verification), GGUF-block products and attention use 16-wide vectors (`avx512()`;
bit-identical results, `DDD_JAX_NO_AVX512=1` keeps AVX2; where they prefetch the next weight block,
`l2_prefetch_rows()`, is speed only).

Numerics: float32 arithmetic; every output element is reduced in one fixed order that depends on the reduced
length only, so a row's result is bit-identical whatever the number of rows computed with it, and a tree node's
attention equals decoding its path one token at a time (see the .cc file's header). Gradients go through XLA.
"""
from __future__ import annotations

import contextlib
import ctypes
import glob
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np

from .. import precision
from .layout import KINDS, from_panels, dequantize_blocks, pack_array, unpack_array

TARGETS = {"ddd_linear": "DddLinear", "ddd_linear_f16": "DddLinearF16", "ddd_linear_blocks": "DddLinearBlocks",
           "ddd_linear_panels": "DddLinearPanels", "ddd_linear_panels_f16": "DddLinearPanelsF16",
           "ddd_linear_panels_greedy": "DddLinearPanelsGreedy", "ddd_linear_qpanels": "DddLinearQPanels",
           "ddd_linear_panels_greedy_screened": "DddLinearPanelsGreedyScreened",
           "ddd_attention": "DddAttention"}
WEIGHT_DTYPES = (jnp.float32, jnp.float16)  # float16: weight-only storage, widened exactly to float32 on load
MAX_ROWS = 128  # beyond this (prefill, training) XLA's GEMM is the better product
_state: dict = {}


def _library_path() -> str | None:
    here = os.path.dirname(os.path.abspath(__file__))
    found = sorted(glob.glob(os.path.join(here, "_cpu_kernels*.so")))
    return found[0] if found else None


def _warn(msg: str) -> None:
    sys.stderr.write(msg.replace("\n", " ") + "\n")  # one line, once (available() caches the outcome)


def _load() -> bool:
    if os.environ.get("DDD_JAX_NO_KERNELS", "") not in ("", "0"):
        return False
    path = os.environ.get("DDD_JAX_KERNELS_LIB") or _library_path()
    if path is None:
        _warn("ddd_jax: CPU kernel library not built; using XLA's dot (reinstall with g++ to build it)")
        return False
    try:
        lib = ctypes.cdll.LoadLibrary(path)
        if not lib.ddd_cpu_supported():
            return False  # no AVX2/FMA: XLA's dot, silently (nothing to fix)
        lib.ddd_l2_prefetch_rows.restype = ctypes.c_int64
        lib.ddd_panel512_rows.restype = ctypes.c_uint64
        lib.ddd_set_panel512_rows.argtypes = [ctypes.c_uint64]
        for name, symbol in TARGETS.items():
            jax.ffi.register_ffi_target(name, jax.ffi.pycapsule(getattr(lib, symbol)), platform="cpu")
        if hasattr(lib, "DddLinearQPanelsInt8"):  # (a build from before int8 blocks keeps everything else)
            jax.ffi.register_ffi_target("ddd_linear_qpanels_int8", jax.ffi.pycapsule(lib.DddLinearQPanelsInt8),
                                        platform="cpu")
            _choose_int8_variant(lib)
        if hasattr(lib, "DddLinearQPanelsInt8Group"):
            jax.ffi.register_ffi_target("ddd_linear_qpanels_int8_group",
                                        jax.ffi.pycapsule(lib.DddLinearQPanelsInt8Group), platform="cpu")
            _state["int8_group"] = True
        if hasattr(lib, "DddLinearQPanelsInt8Greedy"):
            jax.ffi.register_ffi_target("ddd_linear_qpanels_int8_greedy",
                                        jax.ffi.pycapsule(lib.DddLinearQPanelsInt8Greedy), platform="cpu")
            _state["int8_greedy"] = True
    except Exception as e:  # noqa: BLE001  (any failure here must leave the XLA path working)
        _warn(f"ddd_jax: CPU kernel library {path} not usable ({e}); using XLA's dot")
        return False
    _state["lib"] = lib
    chosen = read_panel_tiles()
    if chosen is not None and lib.ddd_avx512():  # this CPU's measured choice (`choose_panel_tiles`)
        lib.ddd_set_panel512_rows(ctypes.c_uint64(chosen["panel512_rows"]))
    return True


INT8_VARIANTS = ("avx2", "avxvnni", "avx512vnni")  # the kernel's g_i8_variant numbers, in order


def _choose_int8_variant(lib) -> None:
    """Apply DDD_JAX_INT8_VARIANT (if set) at load; a name this CPU lacks is kept as an error that `int8_variant`
    (and so every int8 block product) raises."""
    lib.ddd_int8_variant.restype = ctypes.c_int
    lib.ddd_int8_supported.argtypes = [ctypes.c_int]
    lib.ddd_set_int8_variant.argtypes = [ctypes.c_int]
    want = os.environ.get("DDD_JAX_INT8_VARIANT", "")
    if not want:
        return
    if want not in INT8_VARIANTS:
        _state["int8_error"] = f"DDD_JAX_INT8_VARIANT={want!r}: the variants are {', '.join(INT8_VARIANTS)}"
    elif not lib.ddd_set_int8_variant(INT8_VARIANTS.index(want)):
        have = [v for i, v in enumerate(INT8_VARIANTS) if lib.ddd_int8_supported(i)]
        _state["int8_error"] = (f"DDD_JAX_INT8_VARIANT={want}: this CPU (or this build of the kernel library) lacks "
                                f"it; it has {', '.join(have)}")


def int8_variant() -> str | None:
    """Which integer instructions the int8 block products (`product_qpanels_int8`) use: "avx512vnni"
    (_mm512_dpbusd_epi32), "avxvnni" (_mm256_dpbusd_avx_epi32) or "avx2" (maddubs + madd) -- the best this CPU has
    (avx512vnni only with the AVX-512 paths on, see `avx512()`), or DDD_JAX_INT8_VARIANT's. Every variant gives the
    same bits. None without the kernel (XLA computes the same arithmetic). Raises RuntimeError when
    DDD_JAX_INT8_VARIANT names a variant this CPU lacks."""
    if not available() or not hasattr(_state["lib"], "DddLinearQPanelsInt8"):
        return None
    if "int8_error" in _state:
        raise RuntimeError(_state["int8_error"])
    return INT8_VARIANTS[_state["lib"].ddd_int8_variant()]


def int8_variants() -> tuple:
    """The int8 variants this CPU and build can run (empty without the kernel)."""
    if int8_variant() is None:
        return ()
    return tuple(v for i, v in enumerate(INT8_VARIANTS) if _state["lib"].ddd_int8_supported(i))


def set_int8_variant(name: str) -> None:
    """Use variant `name` for this process (compiled functions follow: the kernel reads it every call). Raises
    ValueError for one this CPU lacks. For tests and benchmarks; the bits never depend on it."""
    if name not in INT8_VARIANTS:
        raise ValueError(f"unknown int8 variant {name!r}; known: {', '.join(INT8_VARIANTS)}")
    if int8_variant() is None or not _state["lib"].ddd_set_int8_variant(INT8_VARIANTS.index(name)):
        raise ValueError(f"int8 variant {name}: this CPU (or build) lacks it; it has {', '.join(int8_variants())}")
    _state.pop("int8_error", None)


def available() -> bool:
    """True when the kernel is registered (loads it on first call)."""
    if "ok" not in _state:
        _state["ok"] = _load()
    return _state["ok"]


@contextlib.contextmanager
def enabled(flag: bool):
    """Within the block, functions traced from now on use (flag=True, if available) or skip the kernels. Already
    compiled functions keep what they were traced with: use fresh `jax.jit` wrappers (tests, A/B benchmarks)."""
    before = available()
    _state["ok"] = bool(flag) and before
    try:
        yield
    finally:
        _state["ok"] = before


def avx512() -> bool:
    """True when x @ W of 3 to 85 rows, GGUF-block products and attention run the AVX-512 paths (this CPU has
    AVX-512 F/VL/BW/DQ and DDD_JAX_NO_AVX512 is unset; bit-identical to the AVX2 path, which runs everything else)."""
    return available() and bool(_state["lib"].ddd_avx512())


def screen() -> bool:
    """True when greedy decoding's lm_head screens the vocabulary with an int8 copy of the output projection and
    recomputes exactly every column that could still be the maximum (`greedy_screened`): this CPU has AVX-512 BF16
    and DDD_JAX_NO_SCREEN is unset. The tokens are the exact kernel's either way; only the speed differs."""
    return available() and bool(_state["lib"].ddd_screen())


def set_screen(on: bool) -> None:
    """Turn the screen off (False) or back on where the CPU has it (True) for this process. The kernel reads the
    switch on every call, so compiled functions follow it (off: the same call runs the exact product). For
    benchmarks and tests."""
    if available():
        _state["lib"].ddd_set_screen(ctypes.c_int(1 if on else 0))


def l2_prefetch_rows() -> int | None:
    """From how many rows the AVX-512 products prefetch weights into L2 rather than L1: 1 (always) on AMD, 6 on
    Intel, `DDD_JAX_L2_PREFETCH_ROWS` when set (the .cc file has the measurements). Panel-major products prefetch at
    one or two rows only (from three rows on the hardware prefetchers follow each panel's stream). Speed only: the
    bits never depend on it. None without the AVX-512 paths."""
    if not avx512():
        return None
    return int(_state["lib"].ddd_l2_prefetch_rows())


def set_l2_prefetch_rows(n: int) -> None:
    """Set `l2_prefetch_rows()` (n >= 1) for this process. For benchmarks."""
    if available():
        _state["lib"].ddd_set_l2_prefetch_rows(ctypes.c_int64(max(1, int(n))))


def panel512_rows() -> int | None:
    """Bit mask of the row counts (bit M: M rows, M < 64) whose 48-column panel products take the AVX-512 tiles
    rather than the AVX2 ones -- the same bits either way, so speed only. None without the AVX-512 paths."""
    if not avx512():
        return None
    return int(_state["lib"].ddd_panel512_rows())


def set_panel512_rows(mask: int) -> None:
    """Set `panel512_rows()` for this process (compiled functions follow it: the kernel reads it every call)."""
    if available():
        _state["lib"].ddd_set_panel512_rows(ctypes.c_uint64(int(mask) & (2 ** 64 - 1)))


def _panel_tiles_path():
    from pathlib import Path
    root = Path(os.environ.get("DDD_JAX_CACHE") or Path.home() / ".cache" / "ddd_jax").expanduser()
    slug = "".join(c if c.isalnum() or c in "._-" else "_" for c in (cpu_model() or "unknown-cpu"))
    return root / "kernels" / f"{slug}-panel-tiles.json"


def read_panel_tiles() -> dict | None:
    import json
    p = _panel_tiles_path()
    try:
        d = json.loads(p.read_text())
        return d if d.get("cpu_model") == cpu_model() and isinstance(d.get("panel512_rows"), int) else None
    except (OSError, ValueError):
        return None


def choose_panel_tiles(rows=range(1, 17), K: int = 576, N: int = 1536, layers: int = 16, rounds: int = 5,
                       save: bool = True) -> dict | None:
    """Time the AVX-512 and the AVX2 tiles of a panel product for each row count in `rows` on this CPU (a stack of
    `layers` K x N float32 weights, streamed from memory as decoding reads them; the two alternating, `rounds`
    times) and keep the faster for each (`set_panel512_rows`). The bits never depend on it. Saved per CPU model
    under $DDD_JAX_CACHE/kernels/ and applied when the kernels load. None without the AVX-512 paths."""
    import json
    import statistics
    import time
    if not avx512():
        return None
    from .layout import pack_array
    rng = np.random.default_rng(0)
    data = jnp.asarray(np.stack([np.asarray(pack_array(jnp.asarray(rng.standard_normal((K, N), np.float32)), 48))
                                 for _ in range(layers)]))
    step = jax.jit(lambda x, d: jax.lax.fori_loop(0, layers, lambda i, acc: acc + product_panels(x, d, N, i)[:, :1],
                                                  jnp.zeros((x.shape[0], 1), jnp.float32)))
    before = panel512_rows()
    timings, mask = {}, before
    try:
        for m in rows:
            x = jnp.asarray(rng.standard_normal((m, K), np.float32))
            ms = {"avx512": [], "avx2": []}
            for variant in ("avx512", "avx2"):  # compile and warm both
                set_panel512_rows(before | (1 << m) if variant == "avx512" else before & ~(1 << m))
                jax.block_until_ready(step(x, data))
            for _ in range(rounds):
                for variant in ("avx512", "avx2"):
                    set_panel512_rows(before | (1 << m) if variant == "avx512" else before & ~(1 << m))
                    t0 = time.perf_counter()
                    jax.block_until_ready(step(x, data))
                    ms[variant].append(1e3 * (time.perf_counter() - t0))
            med = {k: statistics.median(v) for k, v in ms.items()}
            timings[m] = med
            mask = mask | (1 << m) if med["avx512"] <= med["avx2"] else mask & ~(1 << m)
    finally:
        set_panel512_rows(mask)
    out = {"cpu_model": cpu_model(), "panel512_rows": mask, "K": K, "N": N, "layers": layers, "rounds": rounds,
           "ms": {str(m): t for m, t in timings.items()},
           "avx2_rows": [m for m in rows if not (mask >> m) & 1]}
    if save:
        p = _panel_tiles_path()
        p.parent.mkdir(parents=True, exist_ok=True)
        tmp = p.with_name(f".{p.name}.{os.getpid()}")
        tmp.write_text(json.dumps(out, indent=1) + "\n")
        os.replace(tmp, p)  # whole or not at all
        out["path"] = str(p)
    return out


def cpu_model() -> str | None:
    """The CPU's model name (Linux /proc/cpuinfo), for benchmark records."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return None


def set_max_threads(n: int) -> None:
    """Cap the threads one product uses (0: XLA's CPU thread pool size). For benchmarks."""
    if available():
        _state["lib"].ddd_set_max_threads(ctypes.c_int64(n))


def _call(x2, w3, layer, trans: bool):
    """x2 [M, K] float32, w3 [L, K, N] (or [L, N, K] if trans) float32 or float16, layer int32 [] -> [M, N]
    float32."""
    N = w3.shape[1] if trans else w3.shape[2]
    name = "ddd_linear_f16" if w3.dtype == jnp.float16 else "ddd_linear"
    call = jax.ffi.ffi_call(name, jax.ShapeDtypeStruct((x2.shape[0], N), jnp.float32), vmap_method="sequential")
    return call(x2, w3, layer, trans=trans)


def _xla(x2, w3, layer, trans: bool):
    w = jax.lax.dynamic_index_in_dim(w3, layer, 0, keepdims=False).astype(jnp.float32)
    return jnp.dot(x2, w.T if trans else w, precision=precision(x2, w), preferred_element_type=jnp.float32)


def _kernel_product(call, xla, bwd):
    """The differentiable product (x2 [M, K], w, layer, static) -> [M, N] of one kernel: the FFI `call` on CPU and
    `xla` elsewhere (one `platform_dependent`), with `bwd(static, (x2, w, layer), g)` as its VJP (XLA products:
    training never needs the kernel)."""
    def impl(x2, w, layer, static):
        return jax.lax.platform_dependent(x2, w, layer, cpu=lambda a, b, c: call(a, b, c, static),
                                          default=lambda a, b, c: xla(a, b, c, static))

    op = jax.custom_vjp(impl, nondiff_argnums=(3,))
    op.defvjp(lambda x2, w, layer, static: (impl(x2, w, layer, static), (x2, w, layer)), bwd)
    return op


def _product_bwd(trans, res, g):  # XLA products (training never needs the kernel)
    x2, w3, layer = res
    w = jax.lax.dynamic_index_in_dim(w3, layer, 0, keepdims=False).astype(jnp.float32)
    gx = jnp.dot(g, w if trans else w.T, preferred_element_type=jnp.float32)
    gw = (g.T @ x2) if trans else (x2.T @ g)
    gw3 = jnp.zeros_like(w3).at[layer].set(gw.astype(w3.dtype))
    return gx.astype(x2.dtype), gw3, None


_product = _kernel_product(_call, _xla, _product_bwd)


def product(x, w, layer=None, trans: bool = False):
    """x [..., K] @ w[layer] (trans: @ w[layer].T) through the kernel; w is [K, N] / [N, K] or stacked [L, ., .]
    (layer: int32 scalar, may be traced). The caller checks `usable`. Returns [..., N] float32."""
    w3 = w if w.ndim == 3 else w[None]
    layer = jnp.zeros((), jnp.int32) if layer is None else jnp.asarray(layer, jnp.int32)
    K = x.shape[-1]
    impl = _product if available() else _xla  # (registers the targets before anything is lowered)
    out = impl(x.reshape(-1, K), w3, layer, trans)
    return out.reshape(*x.shape[:-1], out.shape[-1])


def _small_f32(x) -> bool:
    """float32 x [..., K] of 1..MAX_ROWS rows, and the kernel library available."""
    rows = 1
    for d in x.shape[:-1]:
        rows *= d
    return x.dtype == jnp.float32 and 0 < rows <= MAX_ROWS and available()


def usable(x, w) -> bool:
    """Whether `product` applies: float32 x, float32 or float16 weights, at most MAX_ROWS rows, kernel available."""
    return w.dtype in WEIGHT_DTYPES and _small_f32(x)


# ----------------------------------------------------------------------------------------------- GGUF blocks
def _blocks_call(x2, b3, layer, kind):
    call = jax.ffi.ffi_call("ddd_linear_blocks", jax.ShapeDtypeStruct((x2.shape[0], b3.shape[1]), jnp.float32),
                            vmap_method="sequential")
    return call(x2, b3, layer, kind=np.int64(KINDS[kind][0]))


def _layer_rows(b3, layer, kind):
    """Layer `layer` of stacked blocks b3 [L, N, .] dequantized: [N, K] float32."""
    return dequantize_blocks(jax.lax.dynamic_index_in_dim(b3, layer, 0, keepdims=False), kind)


def _blocks_xla(x2, b3, layer, kind):
    rows = _layer_rows(b3, layer, kind)
    return jnp.einsum("mk,nk->mn", x2, rows, precision=precision(x2, rows), preferred_element_type=jnp.float32)


def _blocks_bwd(kind, res, g):  # d/dx only: the blocks are constants
    _, b3, layer = res
    return jnp.dot(g, _layer_rows(b3, layer, kind), preferred_element_type=jnp.float32), None, None


_blocks = _kernel_product(_blocks_call, _blocks_xla, _blocks_bwd)


def product_blocks(x, blocks, kind: str, layer=None):
    """x [..., K] @ W.T for W the GGUF blocks `blocks` [N, K/32*bytes] (or stacked [L, N, .] with `layer`, an int32
    scalar, may be traced) of `kind` ("q4_1" | "q8_0" | "q4_0"). Returns [..., N] float32. Float32 x of at most
    MAX_ROWS rows runs the kernel (on CPU, when available); anything else dequantizes with XLA."""
    b3 = blocks if blocks.ndim == 3 else blocks[None]
    layer = jnp.zeros((), jnp.int32) if layer is None else jnp.asarray(layer, jnp.int32)
    K = x.shape[-1]
    impl = _blocks if _small_f32(x) else _blocks_xla
    out = impl(x.reshape(-1, K).astype(jnp.float32), b3, layer, kind)
    return out.reshape(*x.shape[:-1], out.shape[-1])


# ----------------------------------------------------------------------------------------------- panels
def _panels_call(x2, w4, layer, n):
    name = "ddd_linear_panels_f16" if w4.dtype == jnp.float16 else "ddd_linear_panels"
    call = jax.ffi.ffi_call(name, jax.ShapeDtypeStruct((x2.shape[0], n), jnp.float32), vmap_method="sequential")
    return call(x2, w4, layer)


def _panels_layer(w4, layer, n):
    """Layer `layer` of stacked panels w4 [L, P, K, W], unpacked (and widened): [K, n] float32."""
    return unpack_array(jax.lax.dynamic_index_in_dim(w4, layer, 0, keepdims=False), n).astype(jnp.float32)


def _panels_xla(x2, w4, layer, n):
    w = _panels_layer(w4, layer, n)
    return jnp.dot(x2, w, precision=precision(x2, w), preferred_element_type=jnp.float32)


def _panels_bwd(n, res, g):
    x2, w4, layer = res
    gx = jnp.dot(g, _panels_layer(w4, layer, n).T, preferred_element_type=jnp.float32)
    gw4 = jnp.zeros_like(w4).at[layer].set(pack_array(x2.T @ g, w4.shape[-1]).astype(w4.dtype))
    return gx, gw4, None


_panels = _kernel_product(_panels_call, _panels_xla, _panels_bwd)


def product_panels(x, data, n: int, layer=None):
    """x [..., K] @ W for W a panel-major float32 (or float16: a draft head's) weight (`panels`): data
    [P, K, W] or stacked [L, P, K, W] (W: 16 or 48 columns a panel) with `layer` (an int32 scalar, may be traced);
    n the logical width N.
    Returns [..., N] float32, bitwise the row-major kernel's product. Float32 x of any number of rows runs the
    kernel (on CPU, when available: in passes of 64 rows, so prefill never unpacks); anything else unpacks with
    XLA."""
    w4 = data if data.ndim == 4 else data[None]
    layer = jnp.zeros((), jnp.int32) if layer is None else jnp.asarray(layer, jnp.int32)
    K = x.shape[-1]
    impl = _panels if available() and x.dtype == jnp.float32 else _panels_xla
    out = impl(x.reshape(-1, K).astype(jnp.float32), w4, layer, n)
    return out.reshape(*x.shape[:-1], n)


# ----------------------------------------------------------------------------------------------- quantized panels
def _qpanels_call(x2, w4, layer, static):
    kind, n = static
    call = jax.ffi.ffi_call("ddd_linear_qpanels", jax.ShapeDtypeStruct((x2.shape[0], n), jnp.float32),
                            vmap_method="sequential")
    return call(x2, w4, layer, kind=np.int64(KINDS[kind][0]))


def _qpanels_layer(w4, layer, kind, n, int8=False):
    """Layer `layer` of stacked quantized panels w4 [L, P, nb, .] (`int8`: quad-major quants) dequantized, as output
    rows: [n, K] float32."""
    return dequantize_blocks(from_panels(jax.lax.dynamic_index_in_dim(w4, layer, 0, keepdims=False), kind, n, int8),
                             kind)


def _qpanels_xla(x2, w4, layer, static):
    rows = _qpanels_layer(w4, layer, *static)
    return jnp.einsum("mk,nk->mn", x2, rows, precision=precision(x2, rows), preferred_element_type=jnp.float32)


def _qpanels_bwd(static, res, g, int8=False):  # d/dx only: the blocks are constants
    _, w4, layer = res
    return jnp.dot(g, _qpanels_layer(w4, layer, *static, int8=int8), preferred_element_type=jnp.float32), None, None


_qpanels = _kernel_product(_qpanels_call, _qpanels_xla, _qpanels_bwd)


def product_qpanels(x, data, kind: str, n: int, layer=None):
    """x [..., K] @ W for W GGUF blocks of `kind` stored panel-major (`quant.BlockPanels`): data [P, K/32, 48 *
    block bytes] or stacked [L, P, K/32, .] with `layer` (an int32 scalar, may be traced); n the output width N.
    Returns [..., N] float32, bitwise `product_panels` of the dequantized weight. Float32 x of any number of rows
    runs the kernel (on CPU, when available); anything else dequantizes with XLA."""
    w4 = data if data.ndim == 4 else data[None]
    layer = jnp.zeros((), jnp.int32) if layer is None else jnp.asarray(layer, jnp.int32)
    K = x.shape[-1]
    impl = _qpanels if available() and x.dtype == jnp.float32 else _qpanels_xla
    out = impl(x.reshape(-1, K).astype(jnp.float32), w4, layer, (kind, n))
    return out.reshape(*x.shape[:-1], n)


# ----------------------------------------------------------------------------------------------- int8 blocks
def _qpanels_int8_call(x2, w4, layer, static):
    kind, n = static
    call = jax.ffi.ffi_call("ddd_linear_qpanels_int8", jax.ShapeDtypeStruct((x2.shape[0], n), jnp.float32),
                            vmap_method="sequential")
    return call(x2, w4, layer, kind=np.int64(KINDS[kind][0]))


def quantize_rows_int8(x2):
    """Each row of x2 [M, K] float32 quantized per 32 values to int8 with a float32 scale, as the kernel does:
    amax = max |x|, d = amax / 127, id = 1 / d (0 when d = 0), q = clip(rint(x * id), -127, 127) (rint: half to
    even). Returns (q [M, K/32, 32] int32, d [M, K/32] float32, s [M, K/32] int32 = sum q)."""
    M, K = x2.shape
    xb = x2.reshape(M, K // 32, 32)
    amax = jnp.max(jnp.abs(xb), axis=-1)
    # a divisor of amax's shape behind a barrier: XLA:CPU turns a division by a broadcast constant into a
    # multiplication by its reciprocal, which is not always the correctly rounded quotient
    d = amax / jax.lax.optimization_barrier(jnp.full(amax.shape, 127, jnp.float32))
    inv = jnp.where(d != 0, jnp.float32(1) / jnp.where(d != 0, d, jnp.float32(1)), jnp.float32(0))
    q = jnp.clip(jnp.round(xb * inv[..., None]), -127, 127).astype(jnp.int32)
    return q, d, jnp.sum(q, axis=-1)


def _block_ints(blocks, kind):
    """GGUF rows [N, nb * bytes] -> (quants [N, nb, 32] int32 as the kernel multiplies them: the nibble 0..15 or
    the int8, d [N, nb] float32, m [N, nb] float32 (zeros but for q4_1))."""
    nbytes = KINDS[kind][1]
    N, nb = blocks.shape[0], blocks.shape[1] // nbytes
    b = blocks.reshape(N, nb, nbytes)
    f16 = lambda lo: jax.lax.bitcast_convert_type(b[..., lo:lo + 2], jnp.float16).astype(jnp.float32)  # noqa: E731
    d = f16(0)
    m = f16(2) if kind == "q4_1" else jnp.zeros_like(d)
    if kind == "q8_0":
        q = jax.lax.bitcast_convert_type(b[..., 2:34], jnp.int8).astype(jnp.int32)
    else:
        qs = b[..., 4:20] if kind == "q4_1" else b[..., 2:18]
        q = jnp.concatenate([qs & 0x0F, qs >> 4], axis=-1).astype(jnp.int32)
    return q, d, m


def _qpanels_int8_xla(x2, w4, layer, static):
    """The kernel's arithmetic in XLA: exact integer block sums, then per block acc + float(isum) * (wd * d) (and
    for q4_1 + wm * (d * float(s))), the blocks in order (a scan, so the float steps are the kernel's)."""
    kind, n = static
    q, wd, wm = _block_ints(from_panels(jax.lax.dynamic_index_in_dim(w4, layer, 0, keepdims=False), kind, n, True),
                            kind)
    xq, xd, xs = quantize_rows_int8(x2)
    isum = jnp.einsum("mbk,nbk->bmn", xq, q, preferred_element_type=jnp.int32)
    if kind == "q4_0":
        isum = isum - 8 * xs.T[:, :, None]
    ds = xd * xs.astype(jnp.float32)

    def step(acc, blk):
        i, wdb, wmb, xdb, dsb = blk
        acc = acc + i.astype(jnp.float32) * (wdb[None, :] * xdb[:, None])
        if kind == "q4_1":
            acc = acc + wmb[None, :] * dsb[:, None]
        return acc, None

    acc, _ = jax.lax.scan(step, jnp.zeros((x2.shape[0], n), jnp.float32), (isum, wd.T, wm.T, xd.T, ds.T))
    return acc


def _qpanels_int8_bwd(static, res, g):  # d/dx of the float product of the dequantized weight (straight through)
    return _qpanels_bwd(static, res, g, int8=True)


_qpanels_int8 = _kernel_product(_qpanels_int8_call, _qpanels_int8_xla, _qpanels_int8_bwd)


def product_qpanels_int8(x, data, kind: str, n: int, layer=None):
    """x [..., K] @ W for W GGUF blocks of `kind` stored panel-major (as `product_qpanels`, the quants quad-major:
    `quant.BlockPanels.int8`), by integer products:
    each row of x quantized per 32 values to int8 with a float32 scale (`quantize_rows_int8`), exact integer sums
    against each weight block, each block's sum scaled in float32 and the blocks summed in order (the .cc file's
    "int8 blocks"). Returns [..., N] float32, close to (not bitwise) the float32 product; a row's result does not
    depend on the other rows, on the threads or on `int8_variant()`. Float32 x on CPU runs the kernel; elsewhere
    XLA computes the same arithmetic."""
    w4 = data if data.ndim == 4 else data[None]
    layer = jnp.zeros((), jnp.int32) if layer is None else jnp.asarray(layer, jnp.int32)
    K = x.shape[-1]
    kernel = available() and x.dtype == jnp.float32 and int8_variant() is not None
    impl = _qpanels_int8 if kernel else _qpanels_int8_xla
    out = impl(x.reshape(-1, K).astype(jnp.float32), w4, layer, (kind, n))
    return out.reshape(*x.shape[:-1], n)


def _qpanels_int8_group_call(x2, ws, layer, static):
    kinds, ns = static
    call = jax.ffi.ffi_call("ddd_linear_qpanels_int8_group",
                            tuple(jax.ShapeDtypeStruct((x2.shape[0], n), jnp.float32) for n in ns),
                            vmap_method="sequential")
    return tuple(call(x2, layer, *ws, kinds=np.array([KINDS[k][0] for k in kinds], np.int64)))


def _qpanels_int8_group_xla(x2, ws, layer, static):
    return tuple(_qpanels_int8_xla(x2, w, layer, s) for w, s in zip(ws, zip(*static)))


def _qpanels_int8_group_bwd(static, res, gs):  # the sum of each product's straight-through d/dx
    x2, ws, layer = res
    gx = sum(_qpanels_bwd(s, (x2, w, layer), g, int8=True)[0] for w, s, g in zip(ws, zip(*static), gs))
    return gx, tuple(None for _ in ws), None


_qpanels_int8_group = _kernel_product(_qpanels_int8_group_call, _qpanels_int8_group_xla, _qpanels_int8_group_bwd)


def product_qpanels_int8_group(x, datas, kinds, ns, layer=None):
    """(x @ W_g for each g): `product_qpanels_int8(x, datas[g], kinds[g], ns[g], layer)` of one input and several
    weights of its K (q, k and v; gate and up), each result bitwise that product's. On CPU one kernel call
    quantizes x once and shares every weight's panels between the threads; elsewhere XLA computes each."""
    ws = tuple(d if d.ndim == 4 else d[None] for d in datas)
    layer = jnp.zeros((), jnp.int32) if layer is None else jnp.asarray(layer, jnp.int32)
    K = x.shape[-1]
    kernel = (available() and x.dtype == jnp.float32 and int8_variant() is not None
              and _state.get("int8_group", False))
    impl = _qpanels_int8_group if kernel else _qpanels_int8_group_xla
    outs = impl(x.reshape(-1, K).astype(jnp.float32), ws, layer, (tuple(kinds), tuple(ns)))
    return tuple(o.reshape(*x.shape[:-1], n) for o, n in zip(outs, ns))


def _panels_greedy_call(x2, w4, layer, n):
    M = x2.shape[0]
    call = jax.ffi.ffi_call("ddd_linear_panels_greedy", (jax.ShapeDtypeStruct((M, n), jnp.float32),
                                                         jax.ShapeDtypeStruct((M,), jnp.int32)),
                            vmap_method="sequential")
    return call(x2, w4, layer)


def greedy_panels(x, data, n: int, first_max):
    """`product_panels(x, data, n)` and each row's greedy token in one kernel call (on CPU, when available): returns
    (logits [..., n] float32, tokens [...] int32), the tokens equal to `first_max(logits)` -- `verify.greedy_token`:
    the first maximum, n - 1 for a row holding a NaN -- which is what runs elsewhere. For greedy decoding's lm_head:
    the kernel scans each column chunk while it is in cache instead of XLA's passes over the logits afterwards. Not
    differentiable (decoding only)."""
    w4 = data if data.ndim == 4 else data[None]
    kernel = available() and x.dtype == jnp.float32 and w4.dtype == jnp.float32  # the kernel reads float32 panels
    return _greedy_head(x, w4, n, first_max, kernel, lambda a, b, c: _panels_greedy_call(a, b, c, n),
                        lambda a, b, c: _panels_xla(a, b, c, n))


def _greedy_head(x, w4, n: int, first_max, kernel: bool, call, logits_xla):
    """(logits [..., n] float32, tokens [...] int32) of x against the output projection w4: where `kernel`, the greedy
    kernel `call(x2, w4, layer)` (the logits and each row's first maximum in one pass) on CPU; elsewhere
    `logits_xla(x2, w4, layer)` and `first_max` of its logits."""
    layer = jnp.zeros((), jnp.int32)
    x2 = x.reshape(-1, x.shape[-1]).astype(jnp.float32)

    def xla(a, b, c):
        logits = logits_xla(a, b, c)
        return logits, first_max(logits)

    if kernel:
        logits, ids = jax.lax.platform_dependent(x2, w4, layer, cpu=call, default=xla)
    else:
        logits, ids = xla(x2, w4, layer)
    return logits.reshape(*x.shape[:-1], n), ids.reshape(x.shape[:-1])


def _qpanels_int8_greedy_call(x2, w4, layer, static):
    kind, n = static
    call = jax.ffi.ffi_call("ddd_linear_qpanels_int8_greedy", (jax.ShapeDtypeStruct((x2.shape[0], n), jnp.float32),
                                                               jax.ShapeDtypeStruct((x2.shape[0],), jnp.int32)),
                            vmap_method="sequential")
    return call(x2, w4, layer, kind=np.int64(KINDS[kind][0]))


def greedy_qpanels_int8(x, data, kind: str, n: int, first_max):
    """`product_qpanels_int8(x, data, kind, n)` and each row's greedy token in one kernel call (on CPU, when
    available): (logits [..., n] float32, tokens [...] int32), the tokens `first_max(logits)`'s, as `greedy_panels`
    for an int8 output projection. Not differentiable (decoding only)."""
    w4 = data if data.ndim == 4 else data[None]
    static = (kind, n)
    kernel = (available() and x.dtype == jnp.float32 and int8_variant() is not None
              and _state.get("int8_greedy", False))
    return _greedy_head(x, w4, n, first_max, kernel, lambda a, b, c: _qpanels_int8_greedy_call(a, b, c, static),
                        lambda a, b, c: _qpanels_int8_xla(a, b, c, static))


def _screened_call(x2, w4, layer, scr, bound):
    M, n = x2.shape[0], bound.shape[-1]
    call = jax.ffi.ffi_call("ddd_linear_panels_greedy_screened", (jax.ShapeDtypeStruct((M,), jnp.int32),
                                                                  jax.ShapeDtypeStruct((M, n), jnp.float32)),
                            vmap_method="sequential")
    return call(x2, w4, layer, scr, bound)[0]


def greedy_screened(x, data, n: int, scr, bound, first_max):
    """Each row's greedy token of x [..., K] @ the panel-major output projection `data` ([P, K, W] float32, n
    columns), screened by its int8 copy `scr` [ceil(n / 48), ceil(K / 2), 96] with per-column error bounds and
    scales `bound` [3, n] (`panels.screen_of`): returns tokens [...] int32, equal to `first_max(product_panels(x,
    data, n))` -- the exact first maximum, n - 1 for a row holding a NaN -- on every path. On CPU with AVX-512 BF16
    the kernel computes the products in bfloat16 (the int8 weights widen exactly), keeps the columns whose error
    interval reaches the row's best lower bound (a certified bound: the exact maximum is always kept) and
    recomputes those exactly from `data`; elsewhere (and for a row it cannot bound) it runs the exact kernel; off
    CPU, XLA's product and `first_max`."""
    w4 = data if data.ndim == 4 else data[None]
    layer = jnp.zeros((), jnp.int32)
    K = x.shape[-1]
    x2 = x.reshape(-1, K).astype(jnp.float32)

    def xla(a, b, c, d, e):
        return first_max(_panels_xla(a, b, c, n))

    if available() and x.dtype == jnp.float32 and w4.dtype == jnp.float32:
        ids = jax.lax.platform_dependent(x2, w4, layer, scr, bound, cpu=_screened_call, default=xla)
    else:
        ids = xla(x2, w4, layer, scr, bound)
    return ids.reshape(x.shape[:-1])


# ----------------------------------------------------------------------------------------------- attention
def _attention_call(q, k5, v5, layer, mask):
    B, T, N, H = q.shape
    call = jax.ffi.ffi_call("ddd_attention", jax.ShapeDtypeStruct((B, T, N * H), jnp.float32),
                            vmap_method="sequential")
    return call(q, k5, v5, layer, mask)


def _attention_impl(q, k5, v5, layer, mask, reference):
    return jax.lax.platform_dependent(
        q, k5, v5, layer, mask, cpu=_attention_call,
        default=lambda q, k5, v5, layer, mask: reference(q, k5[layer], v5[layer], mask))


def _attention_fwd(q, k5, v5, layer, mask, reference):
    return _attention_impl(q, k5, v5, layer, mask, reference), (q, k5, v5, layer, mask)


def _attention_bwd(reference, res, g):  # XLA's attention differentiated (training never needs the kernel)
    q, k5, v5, layer, mask = res
    _, vjp = jax.vjp(lambda q, k5, v5: reference(q, k5[layer], v5[layer], mask), q, k5, v5)
    return (*vjp(g), None, None)


_attention = jax.custom_vjp(_attention_impl, nondiff_argnums=(5,))
_attention.defvjp(_attention_fwd, _attention_bwd)


def attention(q, k, v, mask, layer, reference):
    """Masked GQA attention through the kernel: q [B, T, N, H]; k, v [L, B, K, S, H] with `layer` (or [B, K, S, H]
    when layer is None); mask [B, T, S] bool. Returns [B, T, N*H] float32. `reference` is the XLA implementation
    with the same signature minus layer (used off CPU and for gradients)."""
    if layer is None:
        k, v, layer = k[None], v[None], 0
    if not available():
        return reference(q, k[layer], v[layer], mask)
    return _attention(q, k, v, jnp.asarray(layer, jnp.int32), mask, reference)


def attention_usable(q, k) -> bool:
    rows = q.shape[0] * q.shape[1]
    return q.dtype == jnp.float32 and k.dtype == jnp.float32 and 0 < rows <= MAX_ROWS and available()
