// Values as JSON text: the tojson filter's AppendJson (value.h), as
// transformers' tojson writes it (json.dumps with its options).
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <string>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "model/tokenizer/jinja/text.h"
#include "model/tokenizer/jinja/value.h"

namespace moh {
namespace jinja {

namespace {

void AppendJsonString(const std::string& s, bool ensure_ascii,
                      std::string* out) {
  out->push_back('"');
  for (char32_t c : DecodeUtf8(s)) {
    switch (c) {
      case '"':
        out->append("\\\"");
        continue;
      case '\\':
        out->append("\\\\");
        continue;
      case '\n':
        out->append("\\n");
        continue;
      case '\r':
        out->append("\\r");
        continue;
      case '\t':
        out->append("\\t");
        continue;
      case '\b':
        out->append("\\b");
        continue;
      case '\f':
        out->append("\\f");
        continue;
    }
    char buf[16];
    if (c < 0x20 || (ensure_ascii && c > 0x7E && c < 0x10000)) {
      std::snprintf(buf, sizeof(buf), "\\u%04x", static_cast<unsigned>(c));
      out->append(buf);
    } else if (ensure_ascii && c >= 0x10000) {
      const char32_t v = c - 0x10000;
      std::snprintf(buf, sizeof(buf), "\\u%04x\\u%04x",
                    static_cast<unsigned>(0xD800 + (v >> 10)),
                    static_cast<unsigned>(0xDC00 + (v & 0x3FF)));
      out->append(buf);
    } else {
      AppendUtf8(c, out);
    }
  }
  out->push_back('"');
}

class JsonWriter {
 public:
  JsonWriter(const JsonOptions& options, size_t limit, std::string* out)
      : options_(options), limit_(limit), out_(out) {
    const bool indented = options.indent.has_value();
    item_separator_ = indented ? "," : ", ";
    key_separator_ = ": ";
    if (options.separators) {
      item_separator_ = options.separators->first;
      key_separator_ = options.separators->second;
    }
  }

  absl::Status Write(const Value& value, int level) {
    using Kind = Value::Kind;
    switch (value.kind()) {
      case Kind::kNone:
        out_->append("null");
        break;
      case Kind::kBool:
        out_->append(value.AsBool() ? "true" : "false");
        break;
      case Kind::kInt:
        absl::StrAppend(out_, value.AsInt());
        break;
      case Kind::kFloat: {
        const double d = value.AsDouble();
        if (std::isnan(d)) {
          out_->append("NaN");
        } else if (std::isinf(d)) {
          out_->append(d < 0 ? "-Infinity" : "Infinity");
        } else {
          out_->append(FloatRepr(d));
        }
        break;
      }
      case Kind::kString:
        AppendJsonString(value.AsString(), options_.ensure_ascii, out_);
        break;
      case Kind::kList:
        return WriteContainer(
            '[', ']', value.AsList().size(), level,
            [&](size_t i) { return Write(value.AsList()[i], level + 1); });
      case Kind::kDict: {
        std::vector<const std::pair<std::string, Value>*> items;
        for (const auto& item : value.AsDict()) items.push_back(&item);
        if (options_.sort_keys) {
          std::stable_sort(
              items.begin(), items.end(),
              [](const auto* a, const auto* b) { return a->first < b->first; });
        }
        return WriteContainer('{', '}', items.size(), level, [&](size_t i) {
          AppendJsonString(items[i]->first, options_.ensure_ascii, out_);
          out_->append(key_separator_);
          return Write(items[i]->second, level + 1);
        });
      }
      default:
        return absl::InvalidArgumentError(absl::StrCat(
            "Object of type ", value.TypeName(), " is not JSON serializable"));
    }
    return CheckLimit();
  }

 private:
  template <typename WriteItem>
  absl::Status WriteContainer(char open, char close, size_t size, int level,
                              WriteItem write_item) {
    out_->push_back(open);
    if (size == 0) {
      out_->push_back(close);
      return absl::OkStatus();
    }
    for (size_t i = 0; i < size; ++i) {
      if (i > 0) out_->append(item_separator_);
      NewLine(level + 1);
      absl::Status status = write_item(i);
      if (!status.ok()) return status;
    }
    NewLine(level);
    out_->push_back(close);
    return CheckLimit();
  }

  // Stops once past the limit (CheckLimit then fails): a long indent
  // times the depth is not written whole first.
  void NewLine(int level) {
    if (!options_.indent) return;
    out_->push_back('\n');
    for (int i = 0; i < level && out_->size() <= limit_; ++i) {
      out_->append(*options_.indent);
    }
  }

  absl::Status CheckLimit() const {
    if (out_->size() <= limit_) return absl::OkStatus();
    return absl::InvalidArgumentError(
        absl::StrCat("JSON text longer than ", limit_, " bytes"));
  }

  const JsonOptions& options_;
  const size_t limit_;
  std::string* out_;
  std::string item_separator_, key_separator_;
};

}  // namespace

absl::Status AppendJson(const Value& value, const JsonOptions& options,
                        size_t limit, std::string* out) {
  return JsonWriter(options, limit, out).Write(value, 0);
}

}  // namespace jinja
}  // namespace moh
