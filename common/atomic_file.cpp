#include "common/atomic_file.hpp"

#include <dirent.h>
#include <fcntl.h>
#include <signal.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <charconv>
#include <cstring>
#include <filesystem>
#include <utility>

#include <dptrain/error.hpp>

namespace dpt {

namespace {

const char* const kTmpMark = ".tmp";

// The name of `target`'s temporaries up to the pid: TARGET.tmp, with TARGET's name cut to
// 200 bytes so that a name of up to 255 bytes (NAME_MAX) still has temporaries.
std::string temporary_prefix(const std::string& target) {
  const std::filesystem::path p(target);
  return (p.parent_path() / p.filename().string().substr(0, 200)).string() + kTmpMark;
}

// A new temporary file of our own beside `target` (TARGET.tmp<pid>.<n>); O_EXCL never
// touches a file someone else is writing. Returns the descriptor, or -1 with errno set.
int create_temporary(const std::string& target, std::string& name) {
  static std::atomic<unsigned> serial{0};
  int fd = -1;
  for (int attempt = 0; attempt < 100 && fd < 0; ++attempt) {
    name = temporary_prefix(target) + std::to_string(::getpid()) + "." + std::to_string(serial++);
    fd = ::open(name.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0666);
    if (fd < 0 && errno != EEXIST) break;
  }
  return fd;
}

std::string folder_of(const std::string& path) {
  const std::string dir = std::filesystem::path(path).parent_path().string();
  return dir.empty() ? "." : dir;
}

}  // namespace

std::string file_kind(unsigned mode) {
  if (S_ISREG(mode)) return "a regular file";
  if (S_ISDIR(mode)) return "a folder";
  if (S_ISCHR(mode)) return "a character device";
  if (S_ISBLK(mode)) return "a block device";
  if (S_ISFIFO(mode)) return "a FIFO";
  if (S_ISSOCK(mode)) return "a socket";
  if (S_ISLNK(mode)) return "a symlink";
  return "not a regular file";
}

std::string resolve_output_path(const std::string& path) {
  namespace fs = std::filesystem;
  fs::path p = path;
  for (int hops = 0; hops < 40; ++hops) {
    struct stat st {};
    if (::lstat(p.c_str(), &st) != 0 || !S_ISLNK(st.st_mode)) return p.string();
    std::error_code ec;
    const fs::path to = fs::read_symlink(p, ec);
    if (ec) return p.string();  // unreadable: whatever opening it says is the error
    p = to.is_absolute() ? to : p.parent_path() / to;
  }
  throw UsageError("'" + path + "': too many levels of symbolic links");
}

namespace {
// What an output path names now, if anything: stat(path) follows /proc's links too, which
// resolve_output_path (`target`) cannot name (/dev/stdout -> /proc/self/fd/1 -> "pipe:[N]").
bool stat_output(const std::string& path, const std::string& target, struct stat& st) {
  return ::stat(path.c_str(), &st) == 0 || ::stat(target.c_str(), &st) == 0;
}
}  // namespace

void check_output_file(const std::string& path, const std::string& label) {
  if (path.empty()) return;
  auto refuse = [&](const std::string& why) { throw UsageError(label + " '" + path + "': " + why); };
  if (path.back() == '/') refuse("names a folder, not a file");
  const std::string target = resolve_output_path(path);
  const std::string dir = folder_of(target);
  struct stat st {};
  const bool exists = stat_output(path, target, st);
  if (exists && !S_ISREG(st.st_mode)) refuse("is " + file_kind(st.st_mode) + "; only a regular file is replaced");
  // The program's own output redirected to a file: writing there too would overwrite its
  // lines (--metrics /dev/stdout, or the file that `> out.txt` made).
  for (const int fd : {STDOUT_FILENO, STDERR_FILENO}) {
    struct stat out {};
    if (exists && ::fstat(fd, &out) == 0 && out.st_dev == st.st_dev && out.st_ino == st.st_ino)
      refuse(std::string("is this program's standard ") + (fd == STDOUT_FILENO ? "output" : "error") +
             ", where it prints; name a file of its own");
  }
  struct stat dst {};
  if (::stat(dir.c_str(), &dst) != 0) refuse("its folder '" + dir + "' does not exist (" + std::strerror(errno) + ")");
  if (!S_ISDIR(dst.st_mode)) refuse("'" + dir + "' is not a folder");
  // A sticky folder (/tmp) lets only a file's owner, the folder's owner or root replace it.
  const uid_t me = ::geteuid();
  if (exists && (dst.st_mode & S_ISVTX) && me != 0 && st.st_uid != me && dst.st_uid != me)
    refuse("belongs to another user in a sticky folder, so it cannot be replaced");
  // The temporary's name is cut to fit (temporary_prefix), the target's is not: a name the
  // file system refuses would fail only at the rename, after the whole run.
  const std::string name = std::filesystem::path(target).filename().string();
  const long name_max = ::pathconf(dir.c_str(), _PC_NAME_MAX);
  if (name_max > 0 && name.size() > static_cast<size_t>(name_max))
    refuse("its name is " + std::to_string(name.size()) + " bytes long, and its folder's file system allows " +
           std::to_string(name_max));
  // Try what the save will do: create a file of our own beside the target.
  std::string probe;
  const int fd = create_temporary(target, probe);
  if (fd < 0) refuse("cannot create a file in its folder '" + dir + "' (" + std::strerror(errno) + ")");
  ::close(fd);
  ::unlink(probe.c_str());
}

void remove_stale_temporaries(const std::string& target) {
  namespace fs = std::filesystem;
  const std::string base = fs::path(temporary_prefix(target)).filename().string();
  DIR* d = ::opendir(folder_of(target).c_str());
  if (!d) return;
  while (const dirent* e = ::readdir(d)) {
    const std::string name = e->d_name;
    if (name.compare(0, base.size(), base) != 0) continue;
    // TARGET.tmp<pid>.<n>, digits only: anything else is not ours.
    const size_t dot = name.find('.', base.size());
    if (dot == std::string::npos || dot == base.size() || dot + 1 == name.size()) continue;
    const auto digits = [](const std::string& s) { return s.find_first_not_of("0123456789") == std::string::npos; };
    if (!digits(name.substr(base.size(), dot - base.size())) || !digits(name.substr(dot + 1))) continue;
    long pid = 0;
    const auto [end, ec] = std::from_chars(name.data() + base.size(), name.data() + dot, pid);
    if (ec != std::errc() || pid <= 0 || pid == ::getpid()) continue;
    if (::kill(static_cast<pid_t>(pid), 0) == 0 || errno != ESRCH) continue;  // alive (or not ours to ask)
    ::unlink((fs::path(folder_of(target)) / name).c_str());
  }
  ::closedir(d);
}

AtomicFile::AtomicFile(const std::string& path, std::string label, std::string kept)
    : target_(resolve_output_path(path)), label_(std::move(label)), kept_(std::move(kept)) {
  if (path.empty()) fail("an empty path");
  struct stat st {};
  if (stat_output(path, target_, st) && !S_ISREG(st.st_mode))
    fail("is " + file_kind(st.st_mode) + "; only a regular file is replaced");
  remove_stale_temporaries(target_);
  fd_ = create_temporary(target_, tmp_);
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
  // The target may have changed since the constructor looked (a FIFO made meanwhile).
  struct stat st {};
  if (::stat(target_.c_str(), &st) == 0 && !S_ISREG(st.st_mode))
    fail("has become " + file_kind(st.st_mode) + "; it is not replaced");
  if (::rename(tmp_.c_str(), target_.c_str()) != 0) failed("rename");
  renamed_ = true;
  // The rename is durable only once the folder holding the entry is synced too.
  const std::string dir = folder_of(target_);
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
  const std::string of = total_ > 0 ? " of " + std::to_string(total_) : "";  // (a size not told beforehand)
  fail("writing failed after " + std::to_string(written_) + of + " bytes: " + std::strerror(err) + note + kept_);
}

void write_file_atomic(const std::string& path, const std::string& text) {
  AtomicFile f(path, "cannot write '" + path + "'", "");
  f.expect(text.size());
  f.write(text.data(), text.size());
  f.commit();
}

}  // namespace dpt
