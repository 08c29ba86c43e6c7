"""stepserve's C++ CPU kernels (`csrc/`) and their build, done on the machine at first use."""
