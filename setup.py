"""abftgemm: checksum-protected GEMMs and multi-head attention for NumPy and CuPy."""
from setuptools import find_packages, setup

setup(
    name="abftgemm",
    version="0.1.0",
    description="Algorithm-based fault tolerance for matrix products and attention (NumPy/CuPy)",
    long_description=open("README.md", encoding="utf-8").read(),
    long_description_content_type="text/markdown",
    python_requires=">=3.10",
    packages=find_packages(include=["abftgemm", "abftgemm.*", "attention", "attention.*"]),
    package_data={"abftgemm": ["kernels/*.cu", "kernels/*.cuh"],
                  "attention": ["kernels/*.cu", "kernels/*.cuh"]},
    # scipy: numba's np.dot calls BLAS through SciPy's BLAS only; the fused attention core's tile
    # products run through it about 2x faster than numba loops (bench/NOTES.md).
    install_requires=["numpy>=1.24", "numba>=0.59", "ml_dtypes>=0.3", "tqdm>=4.60",
                      "threadpoolctl>=3.1", "scipy>=1.10"],
    extras_require={
        "cuda12": ["cupy-cuda12x>=14.1.1"],
        "cuda13": ["cupy-cuda13x>=14.1.1"],
        "test": ["pytest>=7", "hypothesis>=6.90"],
        # Compiles the CUDA kernels through NVRTC without a GPU (tests/test_kernels_compile.py):
        # CuPy, NVRTC and the CUDA headers, all from pip (no system CUDA toolkit needed).
        "kernels": ["cupy-cuda13x>=14.1.1", "cuda-toolkit[cudart,nvrtc]==13.*"],
        "plots": ["matplotlib>=3.7"],
        # The notebooks draw with matplotlib, so they pull in the plots extra's dependency too.
        "notebooks": ["nbformat>=5.9", "nbclient>=0.9", "ipykernel>=6.25", "matplotlib>=3.7"],
        # Tensors in abftgemm.matmul and attention.torch (the nn.MultiheadAttention drop-in).
        "torch": ["torch>=2.1"],
        # Hugging Face models (attention.hf): AttentionInterface and AttentionMaskInterface.
        "hf": ["torch>=2.4", "transformers>=5.17,<6"],
    },
    entry_points={"console_scripts": ["abft=attention.experiments.cli:main"]},
)
