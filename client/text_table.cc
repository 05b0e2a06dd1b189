#include "client/text_table.h"

#include <algorithm>
#include <utility>

namespace moh::client {

TextTable::TextTable(std::vector<std::string> header)
    : right_aligned_(header.size(), false) {
  rows_.push_back(std::move(header));
}

void TextTable::AddRow(std::vector<std::string> row) {
  row.resize(rows_[0].size());
  rows_.push_back(std::move(row));
}

void TextTable::AlignRight(int column) {
  if (column >= 0 && column < static_cast<int>(right_aligned_.size())) {
    right_aligned_[column] = true;
  }
}

std::string TextTable::Render() const {
  std::vector<size_t> widths(rows_[0].size(), 0);
  for (const auto& row : rows_) {
    for (size_t c = 0; c < row.size(); ++c) {
      widths[c] = std::max(widths[c], row[c].size());
    }
  }
  std::string out;
  for (const auto& row : rows_) {
    std::string line;
    for (size_t c = 0; c < row.size(); ++c) {
      if (c > 0) line += "  ";
      const std::string pad(widths[c] - row[c].size(), ' ');
      line += right_aligned_[c] ? pad + row[c] : row[c] + pad;
    }
    line.erase(line.find_last_not_of(' ') + 1);
    out += line;
    out += '\n';
  }
  return out;
}

}  // namespace moh::client
