// The Python module pfppo_mega._C. Importing it runs the static registrations of the
// pfppo:: torch ops (csrc/ops.cpp, csrc/cuda/ops_cuda.cpp); the module itself only carries
// build facts.
#include <Python.h>

#if defined(__x86_64__) && defined(__GNUC__)
static const char* cpu_isa() {
  __builtin_cpu_init();
  if (__builtin_cpu_supports("x86-64-v4")) return "x86-64-v4";
  if (__builtin_cpu_supports("x86-64-v3")) return "x86-64-v3";
  return "x86-64";
}
#else
static const char* cpu_isa() { return "generic"; }
#endif

static struct PyModuleDef pfppo_c_module = {PyModuleDef_HEAD_INIT, "_C",
                                            "pfppo:: torch ops (fused PPO kernels)", -1,
                                            nullptr};

PyMODINIT_FUNC PyInit__C(void) {
  PyObject* m = PyModule_Create(&pfppo_c_module);
  if (m == nullptr) return nullptr;
#ifdef PFPPO_WITH_CUDA
  PyModule_AddIntConstant(m, "has_cuda", 1);
#else
  PyModule_AddIntConstant(m, "has_cuda", 0);
#endif
  PyModule_AddStringConstant(m, "cpu_isa", cpu_isa());
  return m;
}
