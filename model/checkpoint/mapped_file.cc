#include "model/checkpoint/mapped_file.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"

namespace moh {
namespace {

absl::Status ErrnoStatus(int err, const std::string& what,
                         const std::string& path) {
  std::string message = absl::StrCat(what, " ", path, ": ", std::strerror(err));
  switch (err) {
    case ENOENT:
      return absl::NotFoundError(message);
    case EACCES:
    case EPERM:
      return absl::PermissionDeniedError(message);
    case ENOMEM:
      return absl::ResourceExhaustedError(message);
    default:
      return absl::InternalError(message);
  }
}

}  // namespace

absl::StatusOr<std::shared_ptr<MappedFile>> MappedFile::Open(
    const std::string& path) {
  int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) return ErrnoStatus(errno, "cannot open", path);
  struct stat st;
  if (::fstat(fd, &st) != 0) {
    int err = errno;
    ::close(fd);
    return ErrnoStatus(err, "cannot stat", path);
  }
  if (!S_ISREG(st.st_mode)) {
    ::close(fd);
    return absl::InvalidArgumentError(
        absl::StrCat(path, " is not a regular file"));
  }
  const size_t size = static_cast<size_t>(st.st_size);
  const uint8_t* data = nullptr;
  if (size > 0) {
    void* addr = ::mmap(nullptr, size, PROT_READ, MAP_PRIVATE, fd, 0);
    if (addr == MAP_FAILED) {
      int err = errno;
      ::close(fd);
      return ErrnoStatus(err, "cannot mmap", path);
    }
    data = static_cast<const uint8_t*>(addr);
  }
  ::close(fd);  // The mapping stays valid without the descriptor.
  return std::shared_ptr<MappedFile>(new MappedFile(path, data, size));
}

std::shared_ptr<MappedFile> MappedFile::FromBytes(std::string path,
                                                  std::string_view bytes) {
  std::unique_ptr<uint8_t[]> copy;
  if (!bytes.empty()) {
    copy.reset(new uint8_t[bytes.size()]);
    std::memcpy(copy.get(), bytes.data(), bytes.size());
  }
  std::shared_ptr<MappedFile> file(
      new MappedFile(std::move(path), copy.get(), bytes.size()));
  file->copy_ = std::move(copy);
  return file;
}

MappedFile::~MappedFile() {
  if (data_ != nullptr && copy_ == nullptr) {
    ::munmap(const_cast<uint8_t*>(data_), size_);
  }
}

}  // namespace moh
