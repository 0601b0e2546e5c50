// Files written whole or not at all, the one way dptrain writes what it must not lose
// (checkpoints, charts, benchmark tables): the bytes go to a temporary file of our own
// beside the target (same folder, so the rename is atomic; O_EXCL, so it is never someone
// else's), which is fsynced and renamed over the target, and then the folder is fsynced.
// Until commit() the target keeps its old contents; on any failure, or when commit() is
// never reached, the temporary file is removed. Only regular files are replaced: a target
// that is a device node, a FIFO, a socket or a folder is refused (renaming over /dev/null
// would turn it into a file). A symlink is followed: the file it points to is replaced, in
// its own folder. Internal to the library.
#pragma once
#include <cstdint>
#include <limits>
#include <string>

namespace dpt {

// "a FIFO", "a character device", "a folder", ... (a stat mode), for error messages.
std::string file_kind(unsigned mode);

// Where a write to `path` lands: symlinks followed (a relative link read from its own
// folder); the path itself when it is no link. Throws UsageError for a loop of links.
std::string resolve_output_path(const std::string& path);

// Refuses, before any work is done, a path that an AtomicFile could not replace: one that
// names a folder (or ends in '/'), an existing target that is not a regular file, or one
// whose folder does not let this process create and rename a file there (tried, since
// access() says yes to root on a read-only file system). Throws UsageError
// "<label> 'PATH': <why>", e.g. label "TrainConfig::save".
void check_output_file(const std::string& path, const std::string& label);

// Temporary files of `target` (TARGET.tmp<pid>.<n>) left by processes that no longer
// exist (a save killed half-way) are removed; those of live processes are kept.
void remove_stale_temporaries(const std::string& target);

class AtomicFile {
 public:
  // Errors are dpt::Error reading "<label>: <problem><kept>", e.g. label "checkpoint
  // 'run.safetensors'" and kept "; any previous checkpoint there is unchanged".
  AtomicFile(const std::string& path, std::string label, std::string kept);
  ~AtomicFile();
  AtomicFile(const AtomicFile&) = delete;
  AtomicFile& operator=(const AtomicFile&) = delete;

  // The size the file will have, for errors ("writing failed after 100 of 4096 bytes").
  void expect(uint64_t total) { total_ = total; }
  // For tests: writes fail as on a full disk once `bytes` are written, naming `why`.
  void fail_after(uint64_t bytes, std::string why);
  // Writes all n bytes, or throws.
  void write(const void* data, uint64_t n);
  // fsync, close, rename over the target (unless it has become something other than a
  // regular file meanwhile), fsync its folder: the new file is in place, whole.
  void commit();

 private:
  [[noreturn]] void fail(const std::string& problem) const;
  [[noreturn]] void failed(const char* call) const;  // errno from `call` on the temporary file
  [[noreturn]] void write_failed(int err, const std::string& note) const;

  std::string target_, tmp_, label_, kept_;
  int fd_ = -1;
  uint64_t written_ = 0, total_ = 0;
  uint64_t room_ = std::numeric_limits<uint64_t>::max();
  std::string room_why_;
  bool renamed_ = false;
};

// `text` written to `path` through an AtomicFile; errors read "cannot write 'PATH': ...".
void write_file_atomic(const std::string& path, const std::string& text);

}  // namespace dpt
