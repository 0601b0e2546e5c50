// kernel_trace.cpp — a timeline of what a CUDA program runs, without Nsight Systems (the
// GPU machine has none): a CUPTI injection library. Loaded by the CUDA driver into any
// program (`CUDA_INJECTION64_PATH=build/benchmarks/libdpt_kernel_trace.so`), it records
// every kernel, copy and fill with its GPU start and end, without serializing them (as
// Nsight Compute does), and with DPT_TRACE_API=1 every CUDA runtime call on the host too;
// at exit it writes one line per record to DPT_TRACE_OUT (default kernel_trace.csv):
//   kind,start_ns,end_ns,stream_or_thread,graph_id,name
// with kind K (kernel), M (copy), S (fill) or R (runtime call). kernel_trace.py turns the
// file into a step's timeline: each kernel's time and the gap before it.
#include <cupti.h>
#include <cxxabi.h>

#include <cstdio>
#include <cstdlib>
#include <mutex>
#include <string>
#include <vector>

namespace {

struct Row {
  char kind;
  uint64_t start, end;
  uint64_t where;  // a stream's id (GPU records) or a thread's (runtime calls)
  uint32_t graph;
  std::string name;
};

std::mutex rows_m;
std::vector<Row> rows;
constexpr size_t kBufferBytes = 8 << 20;

void check(CUptiResult r, const char* what) {
  if (r == CUPTI_SUCCESS) return;
  const char* text = nullptr;
  cuptiGetResultString(r, &text);
  std::fprintf(stderr, "kernel_trace: %s failed: %s\n", what, text ? text : "?");
}

std::string demangle(const char* name) {
  if (!name) return "?";
  int status = 0;
  char* d = abi::__cxa_demangle(name, nullptr, nullptr, &status);
  std::string s = status == 0 && d ? d : name;
  std::free(d);
  for (char& c : s)
    if (c == ',') c = ';';  // the file's separator
  return s;
}

void CUPTIAPI buffer_requested(uint8_t** buffer, size_t* size, size_t* max_records) {
  *buffer = static_cast<uint8_t*>(std::aligned_alloc(8, kBufferBytes));
  *size = kBufferBytes;
  *max_records = 0;
}

void CUPTIAPI buffer_completed(CUcontext, uint32_t, uint8_t* buffer, size_t, size_t valid) {
  CUpti_Activity* record = nullptr;
  std::vector<Row> got;
  while (cuptiActivityGetNextRecord(buffer, valid, &record) == CUPTI_SUCCESS) {
    switch (record->kind) {
      case CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL:
      case CUPTI_ACTIVITY_KIND_KERNEL: {
        const auto* k = reinterpret_cast<const CUpti_ActivityKernel10*>(record);
        got.push_back({'K', k->start, k->end, k->streamId, k->graphId, demangle(k->name)});
        break;
      }
      case CUPTI_ACTIVITY_KIND_MEMCPY: {
        const auto* m = reinterpret_cast<const CUpti_ActivityMemcpy6*>(record);
        got.push_back({'M', m->start, m->end, m->streamId, m->graphId,
                       "memcpy kind " + std::to_string(m->copyKind) + " " + std::to_string(m->bytes) + " B"});
        break;
      }
      case CUPTI_ACTIVITY_KIND_MEMSET: {
        const auto* m = reinterpret_cast<const CUpti_ActivityMemset4*>(record);
        got.push_back({'S', m->start, m->end, m->streamId, m->graphId, "memset " + std::to_string(m->bytes) + " B"});
        break;
      }
      case CUPTI_ACTIVITY_KIND_RUNTIME: {
        const auto* a = reinterpret_cast<const CUpti_ActivityAPI*>(record);
        const char* name = nullptr;
        cuptiGetCallbackName(CUPTI_CB_DOMAIN_RUNTIME_API, a->cbid, &name);
        got.push_back({'R', a->start, a->end, a->threadId, 0, name ? name : "?"});
        break;
      }
      default:
        break;
    }
  }
  size_t dropped = 0;
  cuptiActivityGetNumDroppedRecords(nullptr, 0, &dropped);
  if (dropped) std::fprintf(stderr, "kernel_trace: %zu records dropped\n", dropped);
  std::free(buffer);
  std::lock_guard<std::mutex> lk(rows_m);
  for (Row& r : got) rows.push_back(std::move(r));
}

void write_rows() {
  check(cuptiActivityFlushAll(CUPTI_ACTIVITY_FLAG_FLUSH_FORCED), "cuptiActivityFlushAll");
  const char* path = std::getenv("DPT_TRACE_OUT");
  if (!path) path = "kernel_trace.csv";
  FILE* f = std::fopen(path, "w");
  if (!f) {
    std::fprintf(stderr, "kernel_trace: cannot write %s\n", path);
    return;
  }
  std::lock_guard<std::mutex> lk(rows_m);
  std::fprintf(f, "kind,start_ns,end_ns,where,graph,name\n");
  for (const Row& r : rows)
    std::fprintf(f, "%c,%llu,%llu,%llu,%u,%s\n", r.kind, static_cast<unsigned long long>(r.start),
                 static_cast<unsigned long long>(r.end), static_cast<unsigned long long>(r.where), r.graph,
                 r.name.c_str());
  std::fclose(f);
  std::fprintf(stderr, "kernel_trace: %zu records in %s\n", rows.size(), path);
}

}  // namespace

// Called by the CUDA driver when it loads this library (CUDA_INJECTION64_PATH).
extern "C" int InitializeInjection() {
  check(cuptiActivityRegisterCallbacks(buffer_requested, buffer_completed), "cuptiActivityRegisterCallbacks");
  check(cuptiActivityEnable(CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL), "enable kernels");
  check(cuptiActivityEnable(CUPTI_ACTIVITY_KIND_MEMCPY), "enable copies");
  check(cuptiActivityEnable(CUPTI_ACTIVITY_KIND_MEMSET), "enable fills");
  const char* api = std::getenv("DPT_TRACE_API");
  if (api && std::string(api) == "1") check(cuptiActivityEnable(CUPTI_ACTIVITY_KIND_RUNTIME), "enable runtime calls");
  std::atexit(write_rows);
  return 1;
}
