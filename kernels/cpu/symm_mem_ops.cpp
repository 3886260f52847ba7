/*
 * The CPU kernels of the refimpl_symm_mem all-reduce ops, registered with torch's
 * dispatcher in C++ so that a call costs the dispatch and the C kernel, not a trip
 * through Python (SPEC.md SM-18). Built against the installed torch's headers by
 * refimpl/_native.py at the first CPU rendezvous (kernels/cpu/symm_mem.c stays plain C).
 *
 * This file decides nothing that refimpl/symmetric_memory.py does not decide too: it
 * runs the kernel only when the call is plainly valid and its allocation is already
 * rendezvoused for the group, which Python registers here (`rsm_ops_register`). Anything
 * else (a first use that must rendezvous, a bad argument, a handle that failed) goes to
 * the op's Python kernel (`_python_<op>`), which checks, explains and raises; a kernel
 * status other than OK goes to `_python_raise_status`, which raises what Python would.
 * The C kernels come as function pointers from the library Python loaded
 * (`rsm_ops_init`), so this file does not depend on their source.
 */
#include <ATen/core/Tensor.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <ATen/ops/set.h>
#include <torch/library.h>

#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <string>
#include <unordered_map>
#include <vector>

namespace {

using OneShotFn = int (*)(void *, int, int64_t, int64_t, int, int, void *, int64_t);
using TwoShotFn = int (*)(void *, int, int64_t, int64_t, int, int, int64_t);

struct Entry {
  void *group;  // rsm_group of the handle
  std::string group_name;
  int32_t *peer;  // the group's `peer` field
  c10::Storage last_output;  // the last large one-shot result, reused once nobody holds it
};

std::mutex table_mutex;
std::unordered_map<uintptr_t, Entry> table;  // storage address -> rendezvoused allocation
OneShotFn one_shot_fn = nullptr;
TwoShotFn two_shot_fn = nullptr;
int64_t timeout_ns = 60LL * 1000 * 1000 * 1000;
bool enabled = true;  // false while another allocator serves the cpu device type (SM-1)
constexpr int kOpChannel = 0;
// From this size on a one-shot result reuses the storage of the previous one when the
// caller has dropped it: a fresh large allocation costs a page fault per 4 KiB page,
// more than the reduction itself (a one-place cache, per allocation, of memory the
// caller gave back; a result never aliases a live tensor).
constexpr int64_t kReuseBytes = 16 * 1024;

// Codes shared with kernels/cpu/symm_mem.c and SUPPORTED_DTYPES / REDUCE_OPS in Python.
int dtype_code(c10::ScalarType t) {
  switch (t) {
    case c10::ScalarType::Float: return 0;
    case c10::ScalarType::BFloat16: return 1;
    case c10::ScalarType::Half: return 2;
    case c10::ScalarType::Int: return 3;
    case c10::ScalarType::Long: return 4;
    default: return -1;
  }
}

// Only the canonical spellings: Python handles (and explains) everything else.
int op_code(c10::string_view op, int dtype) {
  if (op == "sum") return 0;
  if (op == "avg") return dtype <= 2 ? 1 : -1;
  if (op == "max") return 2;
  if (op == "min") return 3;
  return -1;
}

struct Call {
  void *group = nullptr;
  int32_t *peer = nullptr;
  int64_t offset = 0;
  int dtype = -1, op = -1;
};

// The call's kernel arguments, or false when Python must handle it.
bool plain_call(const at::Tensor &input, c10::string_view reduce_op,
                c10::string_view group_name, Call &call) {
  if (!enabled || !input.is_contiguous() || one_shot_fn == nullptr) return false;
  call.dtype = dtype_code(input.scalar_type());
  if (call.dtype < 0) return false;
  call.op = op_code(reduce_op, call.dtype);
  if (call.op < 0) return false;
  auto storage = reinterpret_cast<uintptr_t>(input.storage().data());
  std::lock_guard<std::mutex> lock(table_mutex);
  auto it = table.find(storage);
  if (it == table.end() || it->second.group_name != group_name) return false;
  call.group = it->second.group;
  call.peer = it->second.peer;
  // From the storage offset: data_ptr() is null for a tensor without elements (SM-20
  // compares offsets, those of empty tensors too).
  call.offset = input.storage_offset() * static_cast<int64_t>(input.element_size());
  return true;
}

c10::OperatorHandle python_op(const char *name) {
  return c10::Dispatcher::singleton().findSchemaOrThrow(name, "");
}

void raise_status(const at::Tensor &input, c10::string_view group_name, const char *where,
                  int status, int peer) {
  static auto op = python_op("refimpl_symm_mem::_python_raise_status")
                       .typed<void(const at::Tensor &, c10::string_view, c10::string_view,
                                   int64_t, int64_t)>();
  op.call(input, group_name, where, status, peer);
}

c10::Storage swap_last_output(uintptr_t storage, c10::Storage next) {
  std::lock_guard<std::mutex> lock(table_mutex);
  auto it = table.find(storage);
  if (it == table.end()) return {};
  std::swap(it->second.last_output, next);
  return next;
}

at::Tensor new_output(const at::Tensor &input) {
  int64_t nbytes = input.numel() * static_cast<int64_t>(input.element_size());
  if (nbytes < kReuseBytes) return at::empty_like(input, at::MemoryFormat::Contiguous);
  auto key = reinterpret_cast<uintptr_t>(input.storage().data());
  c10::Storage last = swap_last_output(key, {});
  if (!last || last.use_count() != 1 || static_cast<int64_t>(last.nbytes()) != nbytes) {
    at::Tensor out = at::empty_like(input, at::MemoryFormat::Contiguous);
    swap_last_output(key, out.storage());
    return out;
  }
  at::Tensor out = at::empty({0}, input.options());
  out.set_(last, 0, input.sizes());  // no strides: contiguous
  swap_last_output(key, std::move(last));
  return out;
}

at::Tensor one_shot_all_reduce(const at::Tensor &input, c10::string_view reduce_op,
                               c10::string_view group_name) {
  Call call;
  if (!plain_call(input, reduce_op, group_name, call)) {
    static auto op = python_op("refimpl_symm_mem::_python_one_shot_all_reduce")
                         .typed<at::Tensor(const at::Tensor &, c10::string_view,
                                           c10::string_view)>();
    return op.call(input, reduce_op, group_name);
  }
  at::Tensor out = new_output(input);
  int status = one_shot_fn(call.group, kOpChannel, call.offset, input.numel(), call.dtype,
                           call.op, out.data_ptr(), timeout_ns);
  if (status != 0) raise_status(input, group_name, "one_shot_all_reduce", status, *call.peer);
  return out;
}

at::Tensor &one_shot_all_reduce_out(const at::Tensor &input, c10::string_view reduce_op,
                                    c10::string_view group_name, at::Tensor &out) {
  Call call;
  bool plain = out.is_contiguous() && out.device().is_cpu() &&
               out.scalar_type() == input.scalar_type() && out.sizes() == input.sizes() &&
               out.storage().data() != input.storage().data() &&
               plain_call(input, reduce_op, group_name, call);
  if (!plain) {
    static auto op = python_op("refimpl_symm_mem::_python_one_shot_all_reduce_out")
                         .typed<at::Tensor &(const at::Tensor &, c10::string_view,
                                             c10::string_view, at::Tensor &)>();
    return op.call(input, reduce_op, group_name, out);
  }
  int status = one_shot_fn(call.group, kOpChannel, call.offset, input.numel(), call.dtype,
                           call.op, out.data_ptr(), timeout_ns);
  if (status != 0) {
    raise_status(input, group_name, "one_shot_all_reduce_out", status, *call.peer);
  }
  return out;
}

at::Tensor &two_shot_all_reduce_(at::Tensor &input, c10::string_view reduce_op,
                                 c10::string_view group_name) {
  Call call;
  if (!plain_call(input, reduce_op, group_name, call)) {
    static auto op = python_op("refimpl_symm_mem::_python_two_shot_all_reduce_")
                         .typed<at::Tensor &(at::Tensor &, c10::string_view,
                                             c10::string_view)>();
    return op.call(input, reduce_op, group_name);
  }
  int status = two_shot_fn(call.group, kOpChannel, call.offset, input.numel(), call.dtype,
                           call.op, timeout_ns);
  if (status != 0) raise_status(input, group_name, "two_shot_all_reduce_", status, *call.peer);
  return input;
}

// ---- one_shot_all_reduce_pointwise (SM-24) -------------------------------------------
// A step "<op> <number>" is ATen's add, sub or mul with a Python number: the number is
// cast to float (for add and sub first rounded to the dtype), the element computed in
// float and rounded to the dtype after each step, as ATen does for float32, bfloat16
// and float16 (no fused multiply-add: built with -ffp-contract=off).
struct Step {
  char op;  // 'a' add, 's' sub, 'm' mul
  float number;
};

// One step "<op> <number>" of `text[begin, end)`, or false when Python must handle (and
// explain) it.
bool parse_step(const std::string &text, size_t begin, size_t end, Step &step) {
  while (begin < end && text[begin] == ' ') ++begin;
  if (end - begin < 5 || text[begin + 3] != ' ') return false;
  std::string op = text.substr(begin, 3);
  if (op == "add") step.op = 'a';
  else if (op == "sub") step.op = 's';
  else if (op == "mul") step.op = 'm';
  else return false;
  std::string number = text.substr(begin + 4, end - begin - 4);
  // Only what Python's float() reads the same way (no hex, no "nan(...)").
  bool named = number == "inf" || number == "-inf" || number == "nan";
  if (!named && number.find_first_not_of("0123456789.eE+-") != std::string::npos) return false;
  char *stop = nullptr;
  double value = std::strtod(number.c_str(), &stop);
  if (number[0] == ' ' || stop != number.c_str() + number.size()) return false;
  step.number = static_cast<float>(value);
  return true;
}

// The steps of a chain "mul 2.0; add 1.0", or false when Python must handle the text.
// The last chain parsed is kept (`cached`): a program passes the same text every call.
bool parse_steps(c10::string_view view, std::vector<Step> &steps, std::string &cached) {
  if (view == cached) return true;
  std::string text(view);
  steps.clear();
  cached.clear();
  for (size_t begin = 0; !text.empty() && begin <= text.size();) {
    size_t end = text.find(';', begin);
    if (end == std::string::npos) end = text.size();
    Step step{};
    if (!parse_step(text, begin, end, step)) {
      steps.clear();
      return false;
    }
    steps.push_back(step);
    begin = end + 1;
  }
  cached = std::move(text);
  return true;
}

// One step over every element, a loop the compiler vectorises for float32.
template <typename T, typename F>
void map_elements(const T *source, T *target, int64_t numel, F f) {
  for (int64_t i = 0; i < numel; ++i) {
    target[i] = static_cast<T>(f(static_cast<float>(source[i])));  // rounded to the dtype
  }
}

template <typename T>
void apply_steps(const T *source, T *target, int64_t numel, const std::vector<Step> &steps) {
  for (const Step &step : steps) {
    // ATen's add and sub read the number as a tensor of the input's dtype (rounded to
    // bfloat16 or float16 first); its mul reads it as a float.
    float c = step.op == 'm' ? step.number : static_cast<float>(static_cast<T>(step.number));
    if (step.op == 'a') map_elements(source, target, numel, [c](float x) { return x + c; });
    else if (step.op == 's') map_elements(source, target, numel, [c](float x) { return x - c; });
    else map_elements(source, target, numel, [c](float x) { return x * c; });
    source = target;  // the next step reads what this one wrote
  }
}

void apply_steps(const at::Tensor &source, at::Tensor &target, const std::vector<Step> &steps) {
  int64_t numel = target.numel();
  if (steps.empty()) {
    if (source.data_ptr() != target.data_ptr()) {
      std::memcpy(target.data_ptr(), source.data_ptr(), numel * target.element_size());
    }
    return;
  }
  switch (target.scalar_type()) {
    case c10::ScalarType::Float:
      apply_steps(source.const_data_ptr<float>(), target.mutable_data_ptr<float>(), numel,
                  steps);
      break;
    case c10::ScalarType::BFloat16:
      apply_steps(source.const_data_ptr<c10::BFloat16>(),
                  target.mutable_data_ptr<c10::BFloat16>(), numel, steps);
      break;
    default:  // Half: plain_pointwise admits no other dtype with steps
      apply_steps(source.const_data_ptr<c10::Half>(), target.mutable_data_ptr<c10::Half>(),
                  numel, steps);
  }
}

struct Chain {
  std::vector<Step> steps;
  std::string text;  // the text `steps` were parsed from
};

bool plain_pointwise(const at::Tensor &buffer, const at::Tensor &input,
                     c10::string_view prologue, c10::string_view epilogue, Chain &before,
                     Chain &after) {
  if (!input.is_contiguous() || !input.device().is_cpu() ||
      input.scalar_type() != buffer.scalar_type() || input.sizes() != buffer.sizes()) {
    return false;
  }
  if (input.storage().data() == buffer.storage().data() &&
      input.data_ptr() != buffer.data_ptr()) {
    return false;  // overlaps the buffer: Python refuses it
  }
  if (!parse_steps(prologue, before.steps, before.text) ||
      !parse_steps(epilogue, after.steps, after.text)) {
    return false;
  }
  auto dtype = buffer.scalar_type();
  bool floating = dtype == c10::ScalarType::Float || dtype == c10::ScalarType::BFloat16 ||
                  dtype == c10::ScalarType::Half;
  return floating || (before.steps.empty() && after.steps.empty());
}

at::Tensor one_shot_all_reduce_pointwise(at::Tensor &buffer, const at::Tensor &input,
                                         c10::string_view reduce_op,
                                         c10::string_view group_name,
                                         c10::string_view prologue,
                                         c10::string_view epilogue) {
  Call call;
  thread_local Chain before, after;
  if (!plain_pointwise(buffer, input, prologue, epilogue, before, after) ||
      !plain_call(buffer, reduce_op, group_name, call)) {
    static auto op = python_op("refimpl_symm_mem::_python_one_shot_all_reduce_pointwise")
                         .typed<at::Tensor(at::Tensor &, const at::Tensor &, c10::string_view,
                                           c10::string_view, c10::string_view,
                                           c10::string_view)>();
    return op.call(buffer, input, reduce_op, group_name, prologue, epilogue);
  }
  apply_steps(input, buffer, before.steps);
  at::Tensor out = new_output(buffer);
  int status = one_shot_fn(call.group, kOpChannel, call.offset, buffer.numel(), call.dtype,
                           call.op, out.data_ptr(), timeout_ns);
  if (status != 0) {
    raise_status(buffer, group_name, "one_shot_all_reduce_pointwise", status, *call.peer);
  }
  apply_steps(out, out, after.steps);
  return out;
}

}  // namespace

extern "C" {

void rsm_ops_init(void *one_shot, void *two_shot) {
  one_shot_fn = reinterpret_cast<OneShotFn>(one_shot);
  two_shot_fn = reinterpret_cast<TwoShotFn>(two_shot);
}

void rsm_ops_set_timeout(int64_t ns) { timeout_ns = ns; }

/* Whether refimpl's CPU allocator is the registered one for `cpu` (SM-1). */
void rsm_ops_enable(int on) { enabled = on != 0; }

/* The allocation whose storage starts at `storage` is rendezvoused for `group_name`. */
void rsm_ops_register(uintptr_t storage, void *group, int32_t *peer, const char *group_name) {
  std::lock_guard<std::mutex> lock(table_mutex);
  table[storage] = Entry{group, group_name, peer};
}

/* The allocation died, or its handle failed (SM-19): Python decides from now on. */
void rsm_ops_forget(uintptr_t storage) {
  std::lock_guard<std::mutex> lock(table_mutex);
  table.erase(storage);
}

}  // extern "C"

TORCH_LIBRARY_IMPL(refimpl_symm_mem, CPU, m) {
  m.impl("one_shot_all_reduce", &one_shot_all_reduce);
  m.impl("one_shot_all_reduce_out", &one_shot_all_reduce_out);
  m.impl("two_shot_all_reduce_", &two_shot_all_reduce_);
  m.impl("one_shot_all_reduce_pointwise", &one_shot_all_reduce_pointwise);
}
