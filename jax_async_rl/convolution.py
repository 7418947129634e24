"""2-D convolutions as matmuls for XLA's CPU backend.

`conv_general_dilated` computes what `lax.conv_general_dilated` computes for the scripts' torsos
(NHWC inputs, HWIO kernels, any stride, VALID, SAME or explicit padding), from the same kernel: a
space-to-depth of the input by the stride, then one matmul of the concatenated shifted slices.
XLA's CPU convolution, and above all its kernel gradient, is several times slower than its matmul
(docs/results.md, "The Nature CNN on the CPU"); on GPU and TPU the native convolution runs.

flax's `nn.Conv` takes it as its `conv_general_dilated` argument, so a torso changes by one
argument and its parameters keep their shapes: a checkpoint trained with either form plays with
the other. `--conv` (flags.RunArgs: auto, matmul, native) picks the form for a run; `use` sets it
for the process, read when a function is traced.
"""

import jax
import jax.numpy as jnp
from jax import lax

CHOICES = ("auto", "matmul", "native")
_choice = "auto"


def use(choice: str):
    """The form the process's convolutions take from now on (at their next trace): "matmul",
    "native", or "auto" (matmul on the CPU backend, native on the others)."""
    global _choice
    if choice not in CHOICES:
        raise ValueError(f"convolution {choice!r}: one of {', '.join(CHOICES)}")
    _choice = choice


def matmul_form() -> bool:
    """Whether the convolutions traced now take the matmul form."""
    if _choice == "auto":
        return jax.default_backend() == "cpu"
    return _choice == "matmul"


def unrolled_scans(encoders, steps: int) -> bool:
    """Whether a scan of `steps` gradient steps of a network with these encoders
    (tasks.encoders) unrolls. XLA:CPU runs its native convolutions in a loop ~10x slower than
    unrolled (Nature CNN), so with the native form on a CPU up to 16 steps unroll (Atari's 4 x 4;
    CarRacing's 10 x 32 took 9 GiB and 5+ min to compile); as matmuls they run faster in the
    loop, and compile in a fraction of the time (docs/results.md)."""
    images = any(kind in ("nature", "grid") for kind, _ in encoders)
    return images and steps <= 16 and jax.default_backend() == "cpu" and not matmul_form()


def conv_general_dilated(
    lhs,
    rhs,
    window_strides,
    padding,
    lhs_dilation=None,
    rhs_dilation=None,
    dimension_numbers=None,
    feature_group_count=1,
    batch_group_count=1,
    precision=None,
    preferred_element_type=None,
):
    """`lax.conv_general_dilated`'s signature and result. The matmul form takes 2-D NHWC/HWIO
    convolutions without dilation or groups; anything else, or `matmul_form()` False, is the
    native call."""
    plain = (
        lhs.ndim == 4
        and feature_group_count == 1
        and batch_group_count == 1
        and all(d == 1 for d in (lhs_dilation or (1, 1)))
        and all(d == 1 for d in (rhs_dilation or (1, 1)))
        and is_nhwc(dimension_numbers)
    )
    if not (plain and matmul_form()):
        return lax.conv_general_dilated(
            lhs,
            rhs,
            window_strides,
            padding,
            lhs_dilation=lhs_dilation,
            rhs_dilation=rhs_dilation,
            dimension_numbers=dimension_numbers,
            feature_group_count=feature_group_count,
            batch_group_count=batch_group_count,
            precision=precision,
            preferred_element_type=preferred_element_type,
        )
    if isinstance(padding, str):
        padding = lax.padtype_to_pads(lhs.shape[1:3], rhs.shape[:2], window_strides, padding)
    out = conv_matmul(lhs, rhs, tuple(window_strides), tuple(map(tuple, padding)), precision)
    return out if preferred_element_type is None else out.astype(preferred_element_type)


def is_nhwc(dimension_numbers) -> bool:
    """Whether `dimension_numbers` (strings, ConvDimensionNumbers, or None: NCHW) mean NHWC inputs
    and outputs and HWIO kernels."""
    if dimension_numbers is None:
        return False
    shape = (1, 1, 1, 1)
    wanted = lax.conv_dimension_numbers(shape, shape, ("NHWC", "HWIO", "NHWC"))
    return lax.conv_dimension_numbers(shape, shape, dimension_numbers) == wanted


def conv_matmul(x, kernel, strides, padding, precision=None):
    """The convolution of x [N, H, W, C] with kernel [kh, kw, C, O] at `strides` (sh, sw) after
    zero `padding` ((top, bottom), (left, right)), as `lax.conv_general_dilated` computes it.

    A stride-s convolution with a k-wide kernel is a stride-1 convolution with a ceil(k / s)-wide
    kernel over the input's s x s space-to-depth (the kernel zero-padded to a multiple of s and
    regrouped the same way); a stride-1 convolution is one matmul of the concatenated shifted
    slices (each kernel offset's [N, Ho, Wo, C] view) with the kernel flattened."""
    (kh, kw, c, o), (sh, sw) = kernel.shape, strides
    x = jnp.pad(x, ((0, 0), *(tuple(max(p, 0) for p in pad) for pad in padding), (0, 0)))
    # negative padding crops, as lax's does
    x = x[:, max(-padding[0][0], 0) :, max(-padding[1][0], 0) :]
    x = x[:, : x.shape[1] - max(-padding[0][1], 0), : x.shape[2] - max(-padding[1][1], 0)]
    n, h, w, _ = x.shape
    out_h, out_w = (h - kh) // sh + 1, (w - kw) // sw + 1
    if out_h <= 0 or out_w <= 0:
        return jnp.zeros((n, max(out_h, 0), max(out_w, 0), o), jnp.result_type(x, kernel))
    bh, bw = -(-kh // sh), -(-kw // sw)  # the blocks of s a kernel spans
    rows, cols = (out_h - 1 + bh) * sh, (out_w - 1 + bw) * sw  # the input the output reads
    x = x[:, :rows, :cols]
    x = jnp.pad(x, ((0, 0), (0, rows - x.shape[1]), (0, cols - x.shape[2]), (0, 0)))
    # space-to-depth: [N, rows / sh, cols / sw, sh x sw x C], the kernel regrouped the same way
    x = x.reshape(n, rows // sh, sh, cols // sw, sw, c).transpose(0, 1, 3, 2, 4, 5)
    x = x.reshape(n, rows // sh, cols // sw, sh * sw * c)
    kernel = jnp.pad(kernel, ((0, bh * sh - kh), (0, bw * sw - kw), (0, 0), (0, 0)))
    kernel = kernel.reshape(bh, sh, bw, sw, c, o).transpose(0, 2, 1, 3, 4, 5)
    kernel = kernel.reshape(bh * bw * sh * sw * c, o)
    # stride 1 over the blocks: the shifted slices side by side, one matmul
    slices = [x[:, i : i + out_h, j : j + out_w] for i in range(bh) for j in range(bw)]
    patches = slices[0] if len(slices) == 1 else jnp.concatenate(slices, axis=-1)
    return jnp.dot(patches, kernel, precision=precision)
