// Devices: `cuda:i` for GPU i and `cpu:i` for virtual CPU devices (`cpu` = `cpu:0`).
// Several cpu:i let data parallelism run, and be tested, on a machine without a GPU.
#pragma once
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

namespace dpt {

enum class DeviceType { cpu, cuda };

struct Device {
  DeviceType type = DeviceType::cpu;
  int index = 0;

  bool is_cuda() const { return type == DeviceType::cuda; }
  bool is_cpu() const { return type == DeviceType::cpu; }
  std::string str() const;
  bool operator==(const Device&) const = default;
};

// True when this build has CUDA support compiled in.
bool built_with_cuda();
// Number of usable GPUs; 0 when the build has no CUDA or the driver is missing (on a
// machine without a GPU cudaGetDeviceCount returns an error, not 0).
int cuda_device_count();

// Parses `cuda:0`, `cpu`, `cpu:3`; throws UsageError with a one-line reason.
Device parse_device(std::string_view text);
// The most devices one process trains on (replicas: a list may name a device again, a
// logical replica), and the most CPU devices there are (cpu:0..cpu:1023).
constexpr int kMaxDevices = 1024;
// Parses a comma-separated list of at most kMaxDevices entries and checks that every
// device exists and that CPU and CUDA devices are not mixed.
std::vector<Device> parse_devices(std::string_view list);
// Throws UsageError when `d` does not exist on this machine (e.g. cuda:7 with one GPU).
void check_device(const Device& d);
// "cuda:0 (NVIDIA H200, 140.4 GiB)" or "cpu:0 (host)".
std::string describe_device(const Device& d);
// Where GPU `d` sits on this machine's PCI bus: domain << 16 | bus << 8 | device (printed
// as %04x:%02x:%02x). Processes that name GPUs by index under CUDA_VISIBLE_DEVICES of
// their own (one GPU each, every one of them cuda:0) are told apart by it. Throws
// UsageError for a CPU device.
uint32_t pci_location(const Device& d);
// Lets every pair of distinct GPUs in `devices` read each other's memory directly where
// the hardware allows (copies between the others are staged by the driver).
void enable_peer_access(const std::vector<Device>& devices);
// Whether kernels on `reader` can read `owner`'s memory directly: two distinct GPUs whose
// peer access enable_peer_access turned on.
bool peer_readable(const Device& reader, const Device& owner);
// And over NVLink, where a kernel's reads of the peer run at the link's speed: peers with
// native atomics, which PCIe peers lack (there a copy engine's copy is the faster read).
bool peer_over_nvlink(const Device& reader, const Device& owner);
// Every GPU there is, else {cpu}.
std::vector<Device> default_devices();

}  // namespace dpt
