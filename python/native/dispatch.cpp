// The dispatcher kernels of commfuse.torch's ops, in C++: what keeps a steady-state call of a
// `torch.ops.commfuse` op out of Python (`commfuse/torch/_native.py` loads this library and
// registers its kernels; `_library.py` says which ops get which).
//
// * The autograd kernel (every op): a call that needs a gradient goes to the op's twin
//   (`<op>_autograd`, same schema), whose autograd kernel is Python's `autograd.Function`; any
//   other call goes below autograd to the op's next kernel, as an autograd kernel of
//   PyTorch's own does (version counters of mutated tensors bumped once).
// * The CUDA kernel (the ops whose calls Python prepares: GEMM + reduce-scatter, all-gather +
//   GEMM, the collectives in their three forms: in place, into a new tensor and into a given
//   one): looks up the call's signature (every argument but the
//   tensors' data) in a table of prepared calls; a prepared call allocates the outputs and
//   queues the operator through its C function (`python/src/native.rs`); a signature not in the
//   table runs the twin's CUDA kernel, Python's general path, which then tells the table what
//   later calls of the signature take (`commfuse_native_bind`): the operator, or Python again.
//
// Only libc10 and libtorch_cpu are linked: the current stream comes through c10's device guard
// interface, which the CUDA build of PyTorch implements.

#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <torch/library.h>

#include <atomic>
#include <cstdint>
#include <cstring>
#include <memory>
#include <mutex>
#include <string>
#include <unordered_map>
#include <vector>

namespace {

// The C face of one operator (python/src/native.rs)
struct GemmCall {
  uint64_t m, a, b, bias, out, gathered, stream;
};
struct CollectiveCall {
  uint64_t input, output, stream;
};
using GemmFn = int (*)(const void*, const GemmCall*, char*, size_t);
using CollectiveFn = int (*)(const void*, const CollectiveCall*, char*, size_t);
using ReleaseFn = void (*)(const void*);

// What the CUDA kernel of an op does with its arguments (`commfuse_native_kernel`'s `kind`):
// the GEMMs (A, B, bias, ...; a new output, and the gathered A); the all-reduce in place (its
// first argument); a collective into a new tensor of the input's type (the input first); a
// collective into a given tensor (the output first, then the input)
enum Kind : int { GEMM_RS = 0, AG_GEMM = 1, ALL_REDUCE_INPLACE = 2, COLLECTIVE = 3, COLLECTIVE_INTO = 4 };

// A prepared call: the operator (null: the signature's calls take Python's general path) and
// the outputs it writes
struct Prepared {
  const void* handle = nullptr;
  uintptr_t call = 0;
  ReleaseFn release = nullptr;
  std::vector<int64_t> out_shape;
  c10::ScalarType out_dtype = c10::ScalarType::Undefined;
  // the all-gather + GEMM's second output (the gathered A, or [0, K] when not asked for)
  std::vector<int64_t> gathered_shape;
  bool return_gathered = false;
  int64_t m = 0;

  ~Prepared() {
    if (handle != nullptr && release != nullptr) release(handle);
  }
};

struct Table {
  std::mutex lock;
  std::unordered_map<std::string, std::shared_ptr<const Prepared>> calls;
};

// never destroyed: the operators it holds must not be released after CUDA has gone, at exit
Table& table() {
  static Table* t = new Table;
  return *t;
}

std::atomic<uint64_t> hits{0}, misses{0};

// The signature of the call whose miss is being served by Python, on this thread
thread_local std::string pending;
thread_local bool has_pending = false;
thread_local c10::ScalarType pending_dtype = c10::ScalarType::Undefined;

// Where the GEMM ops' schemas hold out_dtype (checked when the kernel is registered)
constexpr size_t out_dtype_index(Kind k) { return k == GEMM_RS ? 4 : 5; }

// The type of the new output of a call: a GEMM's out_dtype, else A's; a collective's input's;
// none for the kinds that make no new tensor
c10::ScalarType out_dtype(Kind k, torch::jit::Stack* stack, size_t n_args) {
  auto args = torch::jit::last(*stack, n_args);
  if (k == COLLECTIVE) return args[0].toTensor().scalar_type();
  if (k != GEMM_RS && k != AG_GEMM) return c10::ScalarType::Undefined;
  const auto& given = args[out_dtype_index(k)];
  return given.isNone() ? args[0].toTensor().scalar_type() : given.toScalarType();
}

// Every op's twin, by the op's name
std::mutex twins_lock;
std::unordered_map<std::string, c10::OperatorHandle>& twins() {
  static auto* t = new std::unordered_map<std::string, c10::OperatorHandle>;
  return *t;
}

const c10::OperatorHandle& twin_of(const c10::OperatorHandle& op) {
  std::lock_guard<std::mutex> guard(twins_lock);
  auto it = twins().find(op.operator_name().name);
  TORCH_CHECK(it != twins().end(), op.operator_name().name, " has no twin registered");
  return it->second;
}

template <typename T>
void append(std::string& key, T value) {
  key.append(reinterpret_cast<const char*>(&value), sizeof(T));
}

// The signature of a call: everything of its arguments but the tensors' data (shapes, strides,
// types, devices; strings, integers, flags), tagged so that no two differ in one byte string
std::string signature(const c10::OperatorHandle& op, torch::jit::Stack* stack) {
  const auto n = op.schema().arguments().size();
  auto args = torch::jit::last(*stack, n);
  std::string key = op.operator_name().name;
  key.push_back('\0');
  for (const c10::IValue& v : args) {
    if (v.isTensor()) {
      const at::Tensor& t = v.toTensor();
      key.push_back('T');
      append(key, static_cast<int8_t>(t.scalar_type()));
      append(key, static_cast<int16_t>(t.device().type()));
      append(key, static_cast<int16_t>(t.device().index()));
      append(key, static_cast<int64_t>(t.dim()));
      for (int64_t s : t.sizes()) append(key, s);
      for (int64_t s : t.strides()) append(key, s);
    } else if (v.isNone()) {
      key.push_back('N');
    } else if (v.isString()) {
      const auto& s = v.toStringRef();
      key.push_back('S');
      append(key, static_cast<uint64_t>(s.size()));
      key.append(s);
    } else if (v.isInt()) {
      key.push_back('I');
      append(key, v.toInt());
    } else if (v.isBool()) {
      key.push_back(v.toBool() ? 'Y' : 'F');
    } else if (v.isDouble()) {
      key.push_back('D');
      append(key, v.toDouble());
    } else {
      // (a symbolic integer or a list: never in a call that reaches a CUDA kernel of ours)
      key.push_back('?');
      key.append(v.tagKind());
    }
  }
  return key;
}

bool needs_grad(const c10::OperatorHandle& op, torch::jit::Stack* stack) {
  if (!c10::GradMode::is_enabled()) return false;
  for (const c10::IValue& v : torch::jit::last(*stack, op.schema().arguments().size())) {
    if (v.isTensor() && v.toTensor().requires_grad()) return true;
  }
  return false;
}

// The autograd kernel of every op
void route(const c10::OperatorHandle& op, c10::DispatchKeySet keys, torch::jit::Stack* stack) {
  if (needs_grad(op, stack)) {
    twin_of(op).callBoxed(stack);
    return;
  }
  const auto& arguments = op.schema().arguments();
  auto args = torch::jit::last(*stack, arguments.size());
  std::vector<at::Tensor> mutated;
  for (size_t i = 0; i < arguments.size(); ++i) {
    const auto* alias = arguments[i].alias_info();
    if (alias != nullptr && alias->isWrite() && args[i].isTensor())
      mutated.push_back(args[i].toTensor());
  }
  if (keys.has(c10::DispatchKey::Python) || keys.has(c10::DispatchKey::PythonTLSSnapshot)) {
    // a traced call (fake, functional or proxy tensors, a dispatch mode): below autograd only,
    // where tracing sees it as it sees any custom op
    at::AutoDispatchBelowAutograd guard;
    op.redispatchBoxed(keys & c10::after_autograd_keyset, stack);
  } else {
    // below the version counters too, as a backend kernel runs: the op bumps its own, once
    at::AutoDispatchBelowADInplaceOrView guard;
    op.redispatchBoxed(keys & c10::after_ADInplaceOrView_keyset, stack);
  }
  for (auto& t : mutated) {
    if (!t.is_inference()) t.unsafeGetTensorImpl()->bump_version();
  }
}

void check(int code, const char* message) {
  if (code == 0) return;
  TORCH_CHECK_VALUE(code != 1, message);
  TORCH_CHECK(false, message);
}

void* current_stream(const c10::Device& device) {
  const auto* guard = c10::impl::getDeviceGuardImpl(device.type());
  return guard->getStream(device).native_handle();
}

uint64_t address(const at::Tensor& t) { return reinterpret_cast<uintptr_t>(t.data_ptr()); }

// Queues a prepared call; the stack holds the op's arguments, and its outputs afterwards
template <Kind K>
void run_prepared(const Prepared& p, torch::jit::Stack* stack, size_t n_args) {
  char message[512] = {0};
  auto args = torch::jit::last(*stack, n_args);
  const at::Tensor& first = args[0].toTensor();
  const c10::Device device = first.device();
  const uint64_t stream = reinterpret_cast<uintptr_t>(current_stream(device));
  if constexpr (K == ALL_REDUCE_INPLACE || K == COLLECTIVE_INTO) {
    // in place, or (output, input, ...)
    const uint64_t input = K == ALL_REDUCE_INPLACE ? address(first) : address(args[1].toTensor());
    const CollectiveCall call{input, address(first), stream};
    check(reinterpret_cast<CollectiveFn>(p.call)(p.handle, &call, message, sizeof message),
          message);
    torch::jit::drop(*stack, n_args);
  } else if constexpr (K == COLLECTIVE) {
    at::Tensor out = at::empty(p.out_shape, at::TensorOptions().dtype(p.out_dtype).device(device));
    const CollectiveCall call{address(first), address(out), stream};
    check(reinterpret_cast<CollectiveFn>(p.call)(p.handle, &call, message, sizeof message),
          message);
    torch::jit::drop(*stack, n_args);
    torch::jit::push(*stack, std::move(out));
  } else {
    const at::Tensor& b = args[1].toTensor();
    const uint64_t bias = args[2].isNone() ? 0 : address(args[2].toTensor());
    at::Tensor out = at::empty(p.out_shape, at::TensorOptions().dtype(p.out_dtype).device(device));
    GemmCall call{static_cast<uint64_t>(p.m), address(first), address(b), bias, address(out), 0,
                  stream};
    at::Tensor gathered;
    if constexpr (K == AG_GEMM) {
      gathered = at::empty(p.gathered_shape, first.options());
      if (p.return_gathered) call.gathered = address(gathered);
    }
    check(reinterpret_cast<GemmFn>(p.call)(p.handle, &call, message, sizeof message), message);
    torch::jit::drop(*stack, n_args);
    torch::jit::push(*stack, std::move(out));
    if constexpr (K == AG_GEMM) torch::jit::push(*stack, std::move(gathered));
  }
}

// The CUDA kernel of an op that Python prepares
template <Kind K>
void prepared_kernel(const c10::OperatorHandle& op, c10::DispatchKeySet, torch::jit::Stack* stack) {
  const size_t n_args = op.schema().arguments().size();
  std::string key = signature(op, stack);
  std::shared_ptr<const Prepared> found;
  {
    std::lock_guard<std::mutex> guard(table().lock);
    auto it = table().calls.find(key);
    if (it != table().calls.end()) found = it->second;
  }
  if (found && found->handle != nullptr) {
    ++hits;
    run_prepared<K>(*found, stack, n_args);
    return;
  }
  // Python's general path (the twin's CUDA kernel); a signature seen for the first time is
  // left pending for it to bind. A nested miss inside it keeps its own and gives this one
  // back when it returns.
  ++misses;
  const bool first = !found;
  std::string saved = std::move(pending);
  const bool had = has_pending;
  const auto saved_dtype = pending_dtype;
  if (first) {
    pending = std::move(key);
    has_pending = true;
    pending_dtype = out_dtype(K, stack, n_args);
  } else {
    has_pending = false;
  }
  struct Restore {
    std::string& saved;
    bool had;
    c10::ScalarType dtype;
    ~Restore() {
      pending = std::move(saved);
      has_pending = had;
      pending_dtype = dtype;
    }
  } restore{saved, had, saved_dtype};
  twin_of(op).redispatchBoxed(c10::DispatchKeySet(c10::DispatchKey::CUDA), stack);
}

// The registrations, one library per dispatch key; never destroyed (a registration lives as
// long as the process)
std::mutex libraries_lock;
torch::Library& library(c10::DispatchKey key) {
  static auto* libraries = new std::vector<std::pair<c10::DispatchKey, torch::Library*>>;
  for (auto& [k, l] : *libraries) {
    if (k == key) return *l;
  }
  auto* l = new torch::Library(torch::Library::IMPL, "commfuse", key, __FILE__, __LINE__);
  libraries->emplace_back(key, l);
  return *l;
}

// Runs `body`, turning a C++ exception into a message and a non-zero return
template <typename F>
int guarded(char* error, size_t capacity, F body) {
  try {
    body();
    return 0;
  } catch (const std::exception& e) {
    if (error != nullptr && capacity > 0) {
      std::strncpy(error, e.what(), capacity - 1);
      error[capacity - 1] = '\0';
    }
    return 1;
  }
}

}  // namespace

#define COMMFUSE_EXPORT __attribute__((visibility("default")))

extern "C" {

// Makes route() the autograd kernel of commfuse::<op>, whose calls needing a gradient go to
// commfuse::<twin>.
COMMFUSE_EXPORT int commfuse_native_route(const char* op, const char* twin, char* error, size_t capacity) {
  return guarded(error, capacity, [&] {
    auto handle = c10::Dispatcher::singleton().findSchemaOrThrow(
        (std::string("commfuse::") + twin).c_str(), "");
    {
      std::lock_guard<std::mutex> guard(twins_lock);
      twins().insert_or_assign(std::string("commfuse::") + op, handle);
    }
    std::lock_guard<std::mutex> guard(libraries_lock);
    library(c10::DispatchKey::Autograd)
        .impl(op, torch::CppFunction::makeFromBoxedFunction<&route>());
  });
}

// Makes the prepared-call kernel of `kind` (Kind) the CUDA kernel of commfuse::<op>.
COMMFUSE_EXPORT int commfuse_native_kernel(const char* op, int kind, char* error, size_t capacity) {
  return guarded(error, capacity, [&] {
    std::lock_guard<std::mutex> guard(libraries_lock);
    auto& lib = library(c10::DispatchKey::CUDA);
    if (kind == GEMM_RS || kind == AG_GEMM) {
      const auto& schema = c10::Dispatcher::singleton()
                               .findSchemaOrThrow((std::string("commfuse::") + op).c_str(), "")
                               .schema();
      const size_t at = out_dtype_index(static_cast<Kind>(kind));
      TORCH_CHECK(schema.arguments().size() > at && schema.arguments()[at].name() == "out_dtype",
                  "commfuse::", op, ": the GEMM kernels expect out_dtype at argument ", at);
    }
    switch (kind) {
      case GEMM_RS:
        lib.impl(op, torch::CppFunction::makeFromBoxedFunction<&prepared_kernel<GEMM_RS>>());
        break;
      case AG_GEMM:
        lib.impl(op, torch::CppFunction::makeFromBoxedFunction<&prepared_kernel<AG_GEMM>>());
        break;
      case ALL_REDUCE_INPLACE:
        lib.impl(op, torch::CppFunction::makeFromBoxedFunction<
                         &prepared_kernel<ALL_REDUCE_INPLACE>>());
        break;
      case COLLECTIVE:
        lib.impl(op, torch::CppFunction::makeFromBoxedFunction<&prepared_kernel<COLLECTIVE>>());
        break;
      case COLLECTIVE_INTO:
        lib.impl(op,
                 torch::CppFunction::makeFromBoxedFunction<&prepared_kernel<COLLECTIVE_INTO>>());
        break;
      default:
        throw std::invalid_argument("commfuse_native_kernel: unknown kind " +
                                    std::to_string(kind));
    }
  });
}

// Whether a miss of this thread waits for Python to bind it.
COMMFUSE_EXPORT int commfuse_native_pending() { return has_pending ? 1 : 0; }

// Binds the pending signature of this thread: to the operator `handle` (with its call and
// release functions; the reference is the table's from here on) writing an output of
// `out_shape` (of the call's output type) and, for the all-gather + GEMM, a second of
// `gathered_shape` (written when `return_gathered`), for calls of `m` rows; or, with a null
// handle, to Python's general path. Without a pending signature the reference is released.
COMMFUSE_EXPORT void commfuse_native_bind(const void* handle, uintptr_t call, ReleaseFn release,
                          const int64_t* out_shape, int out_dims,
                          const int64_t* gathered_shape, int gathered_dims, int return_gathered,
                          int64_t m) {
  auto p = std::make_shared<Prepared>();
  p->handle = handle;
  p->call = call;
  p->release = release;
  if (!has_pending) return;  // p releases the reference
  p->out_shape.assign(out_shape, out_shape + out_dims);
  p->out_dtype = pending_dtype;
  p->gathered_shape.assign(gathered_shape, gathered_shape + gathered_dims);
  p->return_gathered = return_gathered != 0;
  p->m = m;
  has_pending = false;
  std::lock_guard<std::mutex> guard(table().lock);
  table().calls.insert_or_assign(std::move(pending), std::move(p));
  pending.clear();
}

// Forgets every prepared call (releasing the operators' references).
COMMFUSE_EXPORT void commfuse_native_clear() {
  std::unordered_map<std::string, std::shared_ptr<const Prepared>> dropped;
  {
    std::lock_guard<std::mutex> guard(table().lock);
    dropped.swap(table().calls);
  }
}

// The prepared calls held, and the kernels' hits and misses so far.
COMMFUSE_EXPORT void commfuse_native_counts(uint64_t* held, uint64_t* hit, uint64_t* missed) {
  {
    std::lock_guard<std::mutex> guard(table().lock);
    *held = table().calls.size();
  }
  *hit = hits.load();
  *missed = misses.load();
}

}  // extern "C"
