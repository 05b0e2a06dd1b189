// TextTable: rows of cells printed as aligned columns, for terminal output.
#ifndef MOH_CLIENT_TEXT_TABLE_H_
#define MOH_CLIENT_TEXT_TABLE_H_

#include <string>
#include <vector>

namespace moh::client {

// Columns are separated by two spaces and left-aligned unless AlignRight says
// otherwise; a row with fewer cells than the header prints the rest empty.
// Widths count bytes, so non-ASCII cells may misalign (never truncate).
class TextTable {
 public:
  explicit TextTable(std::vector<std::string> header);

  void AddRow(std::vector<std::string> row);
  void AlignRight(int column);

  // The header line and every row, each ending with '\n'; no trailing spaces.
  std::string Render() const;

 private:
  std::vector<std::vector<std::string>> rows_;  // rows_[0] is the header.
  std::vector<bool> right_aligned_;
};

}  // namespace moh::client

#endif  // MOH_CLIENT_TEXT_TABLE_H_
