#include <dptrain/runtime/device.hpp>

#include <charconv>
#include <cstdio>
#include <mutex>
#include <set>

#include <dptrain/error.hpp>

#if DPT_WITH_CUDA
#include <cuda_runtime_api.h>
#endif

namespace dpt {

std::string Device::str() const { return (is_cuda() ? "cuda:" : "cpu:") + std::to_string(index); }

bool built_with_cuda() { return DPT_WITH_CUDA != 0; }

int cuda_device_count() {
#if DPT_WITH_CUDA
  static const int count = [] {
    int n = 0;
    if (cudaGetDeviceCount(&n) != cudaSuccess) {
      cudaGetLastError();  // no driver or no device: clear the sticky error, report none
      return 0;
    }
    return n;
  }();
  return count;
#else
  return 0;
#endif
}

Device parse_device(std::string_view text) {
  const std::string shown(text);
  auto bad = [&](const std::string& why) { return UsageError("invalid device " + quote_value(shown) + ": " + why); };
  std::string_view kind = text, idx;
  if (auto colon = text.find(':'); colon != std::string_view::npos) {
    kind = text.substr(0, colon);
    idx = text.substr(colon + 1);
    if (idx.empty()) throw bad("missing index after ':'");
  }
  Device d;
  if (kind == "cpu") d.type = DeviceType::cpu;
  else if (kind == "cuda") d.type = DeviceType::cuda;
  else throw bad("expected cpu, cpu:N or cuda:N");
  if (!idx.empty()) {
    auto [end, ec] = std::from_chars(idx.data(), idx.data() + idx.size(), d.index);
    if (ec != std::errc() || end != idx.data() + idx.size() || d.index < 0)
      throw bad("the index must be a non-negative integer");
  } else if (d.is_cuda()) {
    d.index = 0;
  }
  return d;
}

void check_device(const Device& d) {
  if (d.index < 0) throw UsageError("invalid device '" + d.str() + "': an index is at least 0");
  if (d.is_cpu()) {
    if (d.index >= kMaxDevices)
      throw UsageError("invalid device '" + d.str() + "': at most " + std::to_string(kMaxDevices) + " CPU devices");
    return;
  }
  if (!built_with_cuda())
    throw UsageError("device " + d.str() + " is not available: this dptrain was built without CUDA");
  const int n = cuda_device_count();
  if (d.index >= n)
    throw UsageError(
        "device " + d.str() + " is not available: this machine has " +
        (n == 0 ? std::string("no GPU") : std::to_string(n) + " GPU(s), cuda:0..cuda:" + std::to_string(n - 1)));
}

std::vector<Device> parse_devices(std::string_view list) {
  std::vector<Device> out;
  size_t start = 0;
  while (start <= list.size()) {
    size_t comma = list.find(',', start);
    if (comma == std::string_view::npos) comma = list.size();
    auto item = list.substr(start, comma - start);
    if (item.empty()) throw UsageError("invalid device list " + quote_value(list) + ": empty entry");
    if (out.size() == static_cast<size_t>(kMaxDevices))  // the list itself is not repeated: it may be long
      throw UsageError("invalid device list: more than " + std::to_string(kMaxDevices) + " devices");
    Device d = parse_device(item);
    check_device(d);
    if (!out.empty() && out.front().type != d.type)
      throw UsageError("invalid device list " + quote_value(list) + ": CPU and CUDA devices cannot be mixed");
    out.push_back(d);
    start = comma + 1;
  }
  return out;
}

std::string describe_device(const Device& d) {
#if DPT_WITH_CUDA
  if (d.is_cuda()) {
    cudaDeviceProp prop{};
    if (cudaGetDeviceProperties(&prop, d.index) == cudaSuccess) {
      char mem[32];
      std::snprintf(mem, sizeof mem, "%.1f GiB", static_cast<double>(prop.totalGlobalMem) / (1 << 30));
      return d.str() + " (" + prop.name + ", " + mem + ")";
    }
    cudaGetLastError();
  }
#endif
  return d.str() + (d.is_cpu() ? " (host)" : "");
}

uint32_t pci_location(const Device& d) {
  if (!d.is_cuda()) throw UsageError("pci_location: " + d.str() + " is not a GPU");
#if DPT_WITH_CUDA
  int domain = 0, bus = 0, slot = 0;
  for (auto [value, attr] : {std::pair{&domain, cudaDevAttrPciDomainId}, std::pair{&bus, cudaDevAttrPciBusId},
                             std::pair{&slot, cudaDevAttrPciDeviceId}})
    if (const cudaError_t e = cudaDeviceGetAttribute(value, attr, d.index); e != cudaSuccess)
      throw Error("the PCI location of " + d.str() + ": " + cudaGetErrorString(e));
  return static_cast<uint32_t>(domain) << 16 | static_cast<uint32_t>(bus) << 8 | static_cast<uint32_t>(slot);
#else
  throw UsageError("pci_location: " + d.str() + " in a build without CUDA");
#endif
}

namespace {
// The (reader, owner) GPU pairs whose peer access enable_peer_access turned on.
std::mutex peers_mutex;
std::set<std::pair<int, int>> peers_on;
}  // namespace

void enable_peer_access(const std::vector<Device>& devices) {
#if DPT_WITH_CUDA
  for (const Device& a : devices)
    for (const Device& b : devices) {
      if (!a.is_cuda() || !b.is_cuda() || a.index == b.index) continue;
      int can = 0;
      if (cudaDeviceCanAccessPeer(&can, a.index, b.index) != cudaSuccess || !can) continue;
      if (cudaSetDevice(a.index) != cudaSuccess) continue;
      const cudaError_t e = cudaDeviceEnablePeerAccess(b.index, 0);
      if (e != cudaSuccess) cudaGetLastError();
      if (e != cudaSuccess && e != cudaErrorPeerAccessAlreadyEnabled) continue;  // then copies are staged
      std::lock_guard<std::mutex> lock(peers_mutex);
      peers_on.insert({a.index, b.index});
    }
#else
  (void)devices;
#endif
}

bool peer_readable(const Device& reader, const Device& owner) {
  if (!reader.is_cuda() || !owner.is_cuda() || reader.index == owner.index) return false;
  std::lock_guard<std::mutex> lock(peers_mutex);
  return peers_on.count({reader.index, owner.index}) > 0;
}

bool peer_over_nvlink(const Device& reader, const Device& owner) {
#if DPT_WITH_CUDA
  if (!peer_readable(reader, owner)) return false;
  int atomics = 0;
  if (cudaDeviceGetP2PAttribute(&atomics, cudaDevP2PAttrNativeAtomicSupported, reader.index, owner.index) !=
      cudaSuccess) {
    cudaGetLastError();
    return false;
  }
  return atomics != 0;
#else
  (void)reader;
  (void)owner;
  return false;
#endif
}

std::vector<Device> default_devices() {
  std::vector<Device> out;
  for (int i = 0; i < cuda_device_count(); ++i) out.push_back({DeviceType::cuda, i});
  if (out.empty()) out.push_back({DeviceType::cpu, 0});
  return out;
}

}  // namespace dpt
