// The Python module pfppo_mega._C. Importing it runs the static registrations of the
// pfppo:: torch ops (csrc/ops.cpp, csrc/policy_loss.cpp); the module itself carries build
// facts and the ops' mode tables (policy_loss_agg_modes: csrc/policy_loss.h), which Python
// reads instead of writing them again.
#include <Python.h>

#include "policy_loss.h"

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
  PyObject* modes = PyTuple_New(pfppo::kNumAggModes);
  if (modes == nullptr) return nullptr;
  for (int k = 0; k < pfppo::kNumAggModes; ++k) {
    PyTuple_SET_ITEM(modes, k, PyUnicode_FromString(pfppo::kAggModeNames[k]));
  }
  if (PyModule_AddObject(m, "policy_loss_agg_modes", modes) < 0) return nullptr;
  return m;
}
