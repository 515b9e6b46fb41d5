// The Python module pfppo_mega._C. Importing it runs the static registrations of the
// pfppo:: torch ops (csrc/ops.cpp); the module itself carries build facts and each fused op's
// table of modes (csrc/<op>.h), which Python reads instead of writing them again:
//   policy_loss_agg_modes  csrc/policy_loss.h      PFPPO_POLICY_LOSS_AGG_MODES
//   gae_whiten_modes       csrc/gae.h              PFPPO_GAE_WHITEN_MODES
//   logprob_modes          csrc/logprob_entropy.h  PFPPO_LOGPROB_MODES
#include <Python.h>

#include "gae.h"
#include "logprob_entropy.h"
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

// Adds names[0, n) to m as a tuple of str called attr; false on a Python error.
static bool add_table(PyObject* m, const char* attr, const char* const* names, int n) {
  PyObject* t = PyTuple_New(n);
  if (t == nullptr) return false;
  for (int k = 0; k < n; ++k) {
    PyObject* s = PyUnicode_FromString(names[k]);
    if (s == nullptr) {
      Py_DECREF(t);
      return false;
    }
    PyTuple_SET_ITEM(t, k, s);
  }
  if (PyModule_AddObject(m, attr, t) < 0) {
    Py_DECREF(t);
    return false;
  }
  return true;
}

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
  if (!add_table(m, "policy_loss_agg_modes", pfppo::kAggModeNames, pfppo::kNumAggModes) ||
      !add_table(m, "gae_whiten_modes", pfppo::kGaeWhitenNames, pfppo::kNumGaeWhiten) ||
      !add_table(m, "logprob_modes", pfppo::kLogProbModeNames, pfppo::kNumLogProbModes)) {
    return nullptr;
  }
  return m;
}
