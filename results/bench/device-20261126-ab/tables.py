"""The bake-off's tables for shapes not loaded here: the GPTQ build of SmolLM2 (4-bit, group 32) and the 371M
Llama shape's Linear layers with bf16 products (logged by the bake-off itself)."""
import logging, sys, time
logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stdout)
import torch
torch.set_num_threads(2)
from app.cpu.gptq import choose_int4_kernels
from app.cpu.kernel_choice import LinearShape
from app.cpu.linear import choose_kernels

t = time.time()
chosen = choose_int4_kernels("auto", False, [(576, 576, 32), (192, 576, 32), (1536, 576, 32), (576, 1536, 32)])
print("gptq", round(time.time() - t, 2), "s:", {k: getattr(v, "name", type(v).__name__) for k, v in chosen.items()})
if "--gptq-only" not in sys.argv:
    t = time.time()
    shapes = [LinearShape(1536, 1024), LinearShape(1024, 1024), LinearShape(5632, 1024), LinearShape(1024, 2816),
              LinearShape(49152, 1024)]
    chosen = choose_kernels("auto", torch.float32, True, False, shapes)
    print("371m", round(time.time() - t, 2), "s:", {k: getattr(v, "name", type(v).__name__) for k, v in chosen.items()})
