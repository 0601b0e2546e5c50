#include "atomic_file.hpp"

#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <utility>

#include <dptrain/error.hpp>

namespace dpt {

AtomicFile::AtomicFile(const std::string& path, std::string label, std::string kept)
    : target_(path), label_(std::move(label)), kept_(std::move(kept)) {
  // A name of our own beside the target; O_EXCL never touches a file someone else is writing.
  static std::atomic<unsigned> serial{0};
  for (int attempt = 0; attempt < 100 && fd_ < 0; ++attempt) {
    tmp_ = path + ".tmp" + std::to_string(::getpid()) + "." + std::to_string(serial++);
    fd_ = ::open(tmp_.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0666);
    if (fd_ < 0 && errno != EEXIST) break;
  }
  if (fd_ < 0) {
    const int err = errno;
    fail("cannot create '" + tmp_ + "': " + std::strerror(err));
  }
}

AtomicFile::~AtomicFile() {
  if (renamed_) return;
  if (fd_ >= 0) ::close(fd_);
  ::unlink(tmp_.c_str());
}

void AtomicFile::fail_after(uint64_t bytes, std::string why) {
  room_ = bytes;
  room_why_ = std::move(why);
}

void AtomicFile::write(const void* data, uint64_t n) {
  auto p = static_cast<const uint8_t*>(data);
  while (n > 0) {
    const uint64_t chunk = std::min<uint64_t>({n, uint64_t{1} << 30, room_ - written_});
    if (chunk == 0) write_failed(ENOSPC, room_why_);
    const ssize_t k = ::write(fd_, p, chunk);
    if (k < 0 && errno == EINTR) continue;
    if (k < 0) write_failed(errno, "");
    if (k == 0) write_failed(ENOSPC, "");  // a regular file took nothing: no room
    p += k, n -= static_cast<uint64_t>(k), written_ += static_cast<uint64_t>(k);
  }
}

void AtomicFile::commit() {
  if (::fsync(fd_) != 0) failed("fsync");
  if (::close(std::exchange(fd_, -1)) != 0) failed("close");
  if (::rename(tmp_.c_str(), target_.c_str()) != 0) failed("rename");
  renamed_ = true;
  // The rename is durable only once the folder holding the entry is synced too.
  std::string dir = std::filesystem::path(target_).parent_path().string();
  if (dir.empty()) dir = ".";
  const int d = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  // EINVAL: a file system that cannot sync folders; there is nothing more to do.
  const bool synced = d >= 0 && (::fsync(d) == 0 || errno == EINVAL);
  const int err = errno;
  if (d >= 0) ::close(d);
  if (!synced) fail("written, but syncing its folder '" + dir + "' failed: " + std::strerror(err));
}

void AtomicFile::fail(const std::string& problem) const { throw Error(label_ + ": " + problem); }

void AtomicFile::failed(const char* call) const {
  const int err = errno;
  fail(std::string(call) + " of '" + tmp_ + "' failed: " + std::strerror(err) + kept_);
}

void AtomicFile::write_failed(int err, const std::string& note) const {
  fail("writing failed after " + std::to_string(written_) + " of " + std::to_string(total_) +
       " bytes: " + std::strerror(err) + note + kept_);
}

void write_file_atomic(const std::string& path, const std::string& text) {
  AtomicFile f(path, "cannot write '" + path + "'", "");
  f.expect(text.size());
  f.write(text.data(), text.size());
  f.commit();
}

}  // namespace dpt
